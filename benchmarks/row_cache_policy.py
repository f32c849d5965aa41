"""LRU against LFU for the ``ssd`` tier's row cache (modules/embedding/ssd_tier/row_cache.py), on a log's real id stream.

    python benchmarks/row_cache_policy.py --rows 1000000 --hashed 1876986 --fractions 0.1 0.25 0.5 1.0
    python benchmarks/row_cache_policy.py --rows 1000000 --fractions 0.1 0.25 0.5 1.0      # frequency-ordered ids

The training split of the synthetic log (Criteo Kaggle's cardinalities, Zipf ids) is replayed one epoch
in batches, each batch's unique (table, row) pairs going through one :class:`RowCache` per policy, as a
training step sends them (rows marked dirty). Each table's cache holds ``fraction`` × the distinct rows
the epoch touches in it, at least the floor placement gives it (4 × the batch, at most the table), in
whole sets. No training: the tables are one column wide and
start at zero, so what is measured is the policy — hit rate, rows written back (evictions of dirty
rows: the disk writes), rows read back (re-reads of evicted rows: the disk reads) — and the cache's
own time per step. ``--hashed H``: ids hashed to H rows per table (``categorical=hash``); without it
the default frequency-ordered vocabulary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from work_folder import ROOT, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))

from modules.sharding.placement import MIN_SLOTS_PER_ID  # noqa: E402
from modules.embedding.row_init import RowInit  # noqa: E402
from modules.embedding.ssd_tier.backing import BackingTable  # noqa: E402
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache  # noqa: E402
from modules.embedding.ssd_tier.set_victims import CacheTooSmallError  # noqa: E402
from pipeline.config import compose_run_config  # noqa: E402
from pipeline.data.sources import prepare_store  # noqa: E402


def replay(sparse: np.ndarray, sizes: list[int], slots: list[int], policy: str, batch: int) -> dict:
    tables = [BackingTable(torch.zeros(n, 1), [], RowInit(0, 0.0, ((0, n, t),))) for t, n in enumerate(sizes)]
    cache = RowCache(tables, [torch.zeros(s, 1) for s in slots], [[] for _ in slots], policy)
    first = np.cumsum([0, *sizes[:-1]])
    t0 = time.perf_counter()
    for a in range(0, len(sparse), batch):
        ids = torch.from_numpy((sparse[a:a + batch].astype(np.int64) + first).reshape(-1))
        cache.assign(torch.unique(ids), dirty=True)
    cache.drain()
    steps = -(-len(sparse) // batch)
    s = cache.stats
    return {"hit": s.hits / s.lookups, "written": s.rows_written, "read": s.rows_read, "drawn": s.rows_drawn,
            "ms": 1e3 * (time.perf_counter() - t0) / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--hashed", type=int, default=None, help="hash every table to this many rows")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--work", default=None, help="folder for the data (default: a temporary one)")
    args = p.parse_args()
    with work_folder(args.work, "bench-row-cache-policy-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    overrides = [f"paths.cache_dir={work / 'cache'}", f"data.synthetic.rows={args.rows}"]
    if args.hashed:
        overrides += ["data.preprocess.categorical=hash", f"data.preprocess.hash_buckets={args.hashed}"]
    cfg = compose_run_config(overrides)
    store = prepare_store(cfg.data, cfg.paths.cache_dir)
    sparse = np.asarray(store.split("train").sparse)
    sizes = [store.table_sizes[f] for f in store.categorical_names]
    distinct = [len(np.unique(sparse[:, t])) for t in range(sparse.shape[1])]
    # the least cache placement gives a table: 4 × the distinct rows one batch can bring (modules.sharding.placement)
    floor = [min(n, MIN_SLOTS_PER_ID * args.batch) for n in sizes]
    print(f"{len(sparse):,} training rows, {len(sizes)} tables, {sum(sizes):,} rows, {sum(distinct):,} touched; "
          f"batch {args.batch}; {'hashed to ' + format(args.hashed, ',') if args.hashed else 'frequency-ordered ids'}\n")
    print("| cache / touched rows | cache rows | policy | hit rate | rows written back | rows read back | ms per step |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for fraction in args.fractions:
        slots = [max(WAYS, -(-max(f, int(fraction * d)) // WAYS) * WAYS) for f, d in zip(floor, distinct)]
        for policy in ("lru", "lfu"):
            try:
                r = replay(sparse, sizes, slots, policy, args.batch)
            except CacheTooSmallError:
                print(f"| {fraction:g} | {sum(slots):,} | {policy} | too small for a batch | | | |")
                continue
            print(f"| {fraction:g} | {sum(slots):,} | {policy} | {r['hit']:.4f} | {r['written']:,} | {r['read']:,} "
                  f"| {r['ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
