"""The ``model.zch`` remapper on 2 ranks: the mapping split over the ranks (``model.zch.buckets``,
:mod:`modules.embedding.zch.exchange`) against the baseline every rank holding the whole mapping — the design
before 2026-11-27, rebuilt here: each rank all-gathers the global batch's ids, admits them all into a remapper of
every table, and maps its own ids.

Synthetic steps: ``--tables`` tables of ``--rows`` rows; each table's values Zipf(``--zipf``) over ``--spread`` ×
rows distinct values (tables fill and evict), as raw ids; a global batch of ``--batch`` rows, one id per table a row; 2 gloo
processes on this machine, each feeding its half. Every design sees the same batches. Reported per design: the
remapper's milliseconds a step (the slowest rank's, mean over the steps after ``--warmup``; admission rounds
included; ``--repeats`` runs of each, in rotated orders), its mapping's bytes on each rank (the state dict's tensors: MCH buffers and probation lists), and the
ids and rows one rank sends a step. The rows each design returns are checked equal.

    python benchmarks/zch_ranks.py                      # 26 tables × 200,000 rows, batch 8,192
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrec import KeyedJaggedTensor  # noqa: E402

from modules.embedding.zch.config import MISSING_ROW, ZchConfig  # noqa: E402
from modules.embedding.zch.remapper import ZchRemapper  # noqa: E402
from pipeline.data.encoding import raw_ids  # noqa: E402
from pipeline.runtime.launch import free_port  # noqa: E402


BASELINE = "whole mapping on every rank (baseline)"


class WholeMapping(ZchRemapper):
    """The baseline (module docstring): built before the process group, so it holds every table; every step
    all-gathers the ranks' ids (sizes, then the ids padded to the longest) for admission and maps this rank's."""

    @torch.no_grad()
    def forward(self, kjt: KeyedJaggedTensor, time: int = -1) -> KeyedJaggedTensor:
        values = kjt.values()
        per_key = dict(zip(kjt.keys(), torch.split(values, kjt.length_per_key())))
        per_table = {t: torch.cat([per_key[k] for k in keys]) for t, keys in self.features.items()}
        flat = torch.cat(list(per_table.values()))
        sizes = torch.tensor([len(v) for v in per_table.values()], dtype=torch.int64)
        world = dist.get_world_size()
        all_sizes = [torch.empty_like(sizes) for _ in range(world)]
        dist.all_gather(all_sizes, sizes)
        padded = torch.zeros(int(max(int(s.sum()) for s in all_sizes)), dtype=torch.int64)
        padded[:len(flat)] = flat
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        parts = [torch.split(g[:int(s.sum())], s.tolist()) for g, s in zip(gathered, all_sizes)]
        for i, t in enumerate(per_table):
            ids = torch.cat([p[i] for p in parts])
            self.pending[t].append(ids[ids != 0])
        self.pending_steps += 1
        if self.pending_steps >= min(self.interval, 1 << self.rounds):
            self._admit()
        out = torch.cat([self._remap(self.table_of[k], per_key[k]) for k in kjt.keys()])
        out[values == 0] = MISSING_ROW
        return KeyedJaggedTensor(keys=kjt.keys(), values=out, lengths=kjt.lengths(), stride=kjt.stride())


def batches(args: argparse.Namespace) -> list[np.ndarray]:
    """Global steps as [batch, tables] int64 raw ids: each table's Zipf ranks as values, through the raw store's
    own encoding (:func:`pipeline.data.encoding.raw_ids`)."""
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.steps):
        ranks = np.minimum(rng.zipf(args.zipf, (args.batch, args.tables)), args.spread * args.rows).astype(np.uint64)
        out.append(np.stack([raw_ids(ranks[:, i], f"t{i}") for i in range(args.tables)], 1))
    return out


def run(remapper: ZchRemapper, steps: list[np.ndarray], rank: int, world: int, keys: list[str]) -> tuple[list[float], list[torch.Tensor]]:
    remapper.train()
    times, rows = [], []
    half = len(steps[0]) // world
    for step in steps:
        local = torch.from_numpy(np.ascontiguousarray(step[rank * half:(rank + 1) * half].T)).reshape(-1)
        kjt = KeyedJaggedTensor(keys=keys, values=local, lengths=torch.ones(len(local), dtype=torch.int32), stride=half)
        dist.barrier()
        t0 = time.perf_counter()
        rows.append(remapper(kjt).values())
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return times, rows


def worker(rank: int, world: int, port: int, args: argparse.Namespace, steps: list[np.ndarray], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tables = {f"t{i}": [f"k{i}"] for i in range(args.tables)}
    keys = [k for ks in tables.values() for k in ks]
    base_cfg = ZchConfig(rows=args.rows, min_count=args.min_count)
    sizes = base_cfg.table_sizes(list(tables))
    baselines = [WholeMapping(base_cfg, tables, sizes) for _ in range(args.repeats)]  # before the group: every table
    dist.init_process_group("gloo", rank=rank, world_size=world)
    designs = {BASELINE: lambda: baselines.pop()}
    for b in args.buckets:
        cfg = ZchConfig(rows=args.rows, min_count=args.min_count, buckets=b)
        designs[f"split, buckets={b}"] = lambda cfg=cfg: ZchRemapper(cfg, tables, cfg.table_sizes(list(tables)))
    names = list(designs)
    results: dict[str, list] = {name: [[], 0, True] for name in names}
    reference = None
    for r in range(args.repeats):  # each repeat in another order: names rotated
        for name in names[r % len(names):] + names[:r % len(names)]:
            remapper = designs[name]()
            times, rows = run(remapper, steps, rank, world, keys)
            if name == BASELINE and reference is None:
                reference = rows
            held = [torch.tensor([remapper.mapping_bytes()], dtype=torch.int64) for _ in range(world)]
            dist.all_gather(held, held[rank].clone())
            results[name][0].append(float(np.mean(times[args.warmup:])) * 1e3)
            results[name][1] = [int(h) for h in held]
            if name.endswith("=1") or name == BASELINE:  # the baseline runs first: reference set
                results[name][2] &= all(torch.equal(a, b) for a, b in zip(rows, reference))
            else:
                results[name][2] = None
            del remapper
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--spread", type=int, default=4, help="distinct ids a table: spread × rows (Zipf-capped)")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--min-count", type=int, default=2)
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each design, in rotated orders")
    args = parser.parse_args()
    steps = batches(args)
    out = f"/tmp/zch_ranks_{os.getpid()}.pt"
    mp.start_processes(worker, args=(2, free_port(), args, steps, out), nprocs=2, join=True, start_method="spawn")
    results = torch.load(out, weights_only=False)
    os.remove(out)
    print(f"{args.tables} tables × {args.rows:,} rows, global batch {args.batch:,}, {args.steps} steps "
          f"({args.warmup} warm-up), min_count {args.min_count}, 2 gloo ranks on {os.cpu_count()} cores")
    print(f"ids a rank sends a step: baseline {args.batch // 2 * args.tables:,} (to each other rank, gathered); "
          f"split: about half of them to the other rank and as many rows back")
    print("| design | remapper ms / step (slowest rank; each run) | mapping MB rank 0 / rank 1 | rows equal the baseline's |")
    print("|---|---:|---:|---|")
    for name, (ms, held, same) in results.items():
        check = "another row layout" if same is None else "yes" if same else "NO"
        print(f"| {name} | {', '.join(f'{m:.1f}' for m in ms)} | {held[0] / 1e6:.1f} / {held[1] / 1e6:.1f} | {check} |")


if __name__ == "__main__":
    main()
