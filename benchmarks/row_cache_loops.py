"""The row cache's own time per step with its loops in C against their torch / numpy twins, on a log's id stream.

    python benchmarks/row_cache_loops.py --rows 1000000 --cache-mb 121 --set data.synthetic.day=1 \
        data.preprocess.base_vocabulary=<a larger log's store> ...        # the docs/ssd_tier.md case

The training split of the log is replayed in batches through the row caches a DeepFM's ``ssd`` tier has
(modules/embedding/ssd_tier/row_cache.py): the stacked ``emb`` table (16 columns, drawn N(0, 0.01²)) and the
first-order ``wide`` table (4 columns, zeros), each with its row-wise Adagrad state, in memory-mapped files
with sorted runs, sharing ``--cache-mb`` in proportion to their row bytes. Each batch's unique ids go through
both caches as a training forward sends them (rows marked dirty). No training: what is measured is the
cache's lookup, victims, write-back, read-back and drawing — ms per step, the C loops
(``native=True``, modules/embedding/ssd_tier/native_loops.py) against the torch and numpy twins
(``native=False``), in alternating runs. Both see the same stream and must make the same choices: the
hit rate and the rows moved are printed beside the times.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from work_folder import ROOT, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))

from modules.embedding.row_init import RowInit  # noqa: E402
from modules.embedding.ssd_tier.backing import BackingTable, slot_bytes  # noqa: E402
from modules.embedding.ssd_tier.files import mapped_file  # noqa: E402
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache  # noqa: E402
from pipeline.config import compose_run_config  # noqa: E402
from pipeline.data.sources import prepare_store  # noqa: E402

TABLES = (("emb", 16, 0.01), ("wide", 4, 0.0))  # name, columns, initial std


def replay(ids: np.ndarray, rows: int, cache_mb: float, batch: int, steps: int, native: bool, work: Path) -> dict:
    row_bytes = {name: 4 * dim + 4 for name, dim, _ in TABLES}  # with the row-wise Adagrad state
    share = cache_mb * 2**20 / sum(row_bytes.values())
    caches = []
    for name, dim, std in TABLES:
        slots = -(-int(share * row_bytes[name] / slot_bytes(row_bytes[name])) // WAYS) * WAYS
        folder = work / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        table = BackingTable(mapped_file(folder / "weights", rows * dim).view(rows, dim), [mapped_file(folder / "state", rows)],
                             RowInit(0, std, ((0, rows, len(caches)),)))
        caches.append(RowCache([table], [torch.zeros(slots, dim)], [[torch.zeros(slots)]], "lfu", folder / "runs", native))
    t0 = time.perf_counter()
    for step in range(steps):
        unique = torch.unique(torch.from_numpy(ids[step * batch:(step + 1) * batch].reshape(-1)))
        for cache in caches:
            cache.assign(unique, dirty=True)
    for cache in caches:
        cache.drain()
    seconds = time.perf_counter() - t0
    s = caches[0].stats
    for name, _, _ in TABLES:
        shutil.rmtree(work / name, ignore_errors=True)
    return {"ms": 1e3 * seconds / steps, "hit": s.hits / s.lookups, "drawn": s.rows_drawn, "read": s.rows_read,
            "written": s.rows_written, "slots": sum(c.slots for c in caches)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the log (data.synthetic.rows)")
    p.add_argument("--cache-mb", type=float, default=121, help="host memory of both caches together")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=None, help="steps replayed (default: the whole training split)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, e.g. data.synthetic.day=1")
    p.add_argument("--work", default=None, help="folder for the data and the caches' files (default: a temporary one)")
    args = p.parse_args()
    with work_folder(args.work, "bench-row-cache-loops-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    cfg = compose_run_config([f"data.synthetic.rows={args.rows}", f"paths.cache_dir={work / 'cache'}", *args.set])
    store = prepare_store(cfg.data, cfg.paths.cache_dir)
    sparse = np.asarray(store.split("train").sparse).astype(np.int64)
    sizes = [store.table_sizes[f] for f in store.categorical_names]
    ids = sparse + np.cumsum([0, *sizes[:-1]])  # the stacked table's rows
    steps = min(args.steps or len(ids) // args.batch, len(ids) // args.batch)
    print(f"{steps} steps of {args.batch} rows; tables of {sum(sizes):,} rows; caches of {args.cache_mb:g} MB\n")
    print("| loops | run | ms per step | hit rate | rows drawn | rows read back | rows written back | cache slots |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for native in (False, True):
            r = replay(ids, sum(sizes), args.cache_mb, args.batch, steps, native, work / "caches")
            times[native].append(r["ms"])
            print(f"| {'C' if native else 'torch / numpy'} | {repeat + 1} | {r['ms']:.1f} | {r['hit']:.4f} | {r['drawn']:,} "
                  f"| {r['read']:,} | {r['written']:,} | {r['slots']:,} |", flush=True)
    ratio = [t / c for t, c in zip(times[False], times[True])]
    print(f"\ntorch / numpy time over C time, per pair: {', '.join(f'{x:.2f}' for x in ratio)}")


if __name__ == "__main__":
    main()
