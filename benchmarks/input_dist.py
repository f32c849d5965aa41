"""How much of a training step TorchRec's input distribution takes: the most that overlapping it with
compute (``TrainPipelineSparseDist``) could save, on 1 process and on 2 processes over gloo.

    python benchmarks/input_dist.py --rows 2000000 --batch 8192 --steps 60 --procs 1 2 --repeats 2

Each run is a real ``torchrun`` of ``--procs`` processes (the machine's ``--threads`` split between them).
Every rank trains the project's DeepFM (embedding dim 16, MLP 400-400-400, tables sharded by the
project's planner, FBGEMM's fused row-wise Adagrad, Adam for the replicated part) on its share of a
global batch of ``--batch`` rows, in a plain loop: batch, forward, backward, step. The clock around
each sharded collection splits its forward into

* input distribution: from the collection's ``forward`` to its ``compute_and_output_dist`` (the KJT
  permuted per shard and, on 2 processes, sent to the ranks that own the tables: a gloo all-to-all
  the step waits for);
* the rest (lookups, output all-to-all, the model above them, backward, optimizer).

``TrainPipelineSparseDist`` starts batch i+1's input distribution before batch i's forward, so at
best it takes the first part off the step. The table prints the plain loop's samples/s (the baseline),
the input distribution's share of the step, and the samples/s the step would reach without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))


def worker(store_dir: str, batch: int, steps: int, warmup: int = 5) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchrec.distributed.types import ShardedModule

    from modules.embedding.sparse_arch import FeatureSpec
    from modules.models import ModelConfig, build_model
    from modules.optim.optimizers import OptimizerSpec, replicated_parameters
    from modules.sharding.planner import shard_model
    from modules.sharding.table_stacking import decide_stacking
    from modules.sharding.topology import TopologySpec
    from pipeline.data.batches import make_batch
    from pipeline.data.store import ColumnarStore

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = ColumnarStore(store_dir)
    spec = FeatureSpec.from_store_meta(store.meta)
    torch.manual_seed(0)
    optim, topology = OptimizerSpec(name="rowwise_adagrad", lr=0.01, eps=1e-8), TopologySpec().on_ranks(world)
    model_cfg, _ = decide_stacking(ModelConfig(name="deepfm", embedding_dim=16), spec, topology, optim, None)
    net = build_model(model_cfg, spec, device=torch.device("meta"))
    model, _ = shard_model(net, optim, topology, torch.device("cpu"))
    opt = torch.optim.Adam([p for _, p in replicated_parameters(model)], lr=1e-3)
    clock = {"start": 0.0, "input_dist": 0.0}

    def timed(module: ShardedModule) -> None:
        forward, compute = module.forward, module.compute_and_output_dist

        def timed_forward(*args, **kwargs):
            clock["start"] = time.perf_counter()
            return forward(*args, **kwargs)

        def timed_compute(*args, **kwargs):
            clock["input_dist"] += time.perf_counter() - clock["start"]
            return compute(*args, **kwargs)

        module.forward, module.compute_and_output_dist = timed_forward, timed_compute

    for module in model.modules():
        if isinstance(module, ShardedModule):
            timed(module)
    train, keys, local = store.split("train"), list(spec.kjt_keys), batch // world
    order = np.random.default_rng(0).permutation(len(train))
    if (warmup + steps) * batch > len(train):
        raise SystemExit(f"--steps {steps}: the {len(train):,} training rows hold only "
                         f"{len(train) // batch - warmup} measured steps of {batch:,} rows")
    total = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            clock["input_dist"], total = 0.0, 0.0
        t0 = time.perf_counter()
        rows = np.sort(order[i * batch + rank * local:i * batch + (rank + 1) * local])
        b = make_batch(train, rows, keys)
        loss = F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += time.perf_counter() - t0
    times = torch.tensor([total, clock["input_dist"]], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank == 0:
        step, input_dist = (float(t) / steps for t in times)
        print(json.dumps({"step_ms": step * 1e3, "input_dist_ms": input_dist * 1e3,
                          "samples_per_s": batch / step, "without_input_dist": batch / (step - input_dist)}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="synthetic rows generated (85 %% train)")
    p.add_argument("--batch", type=int, default=8192, help="global batch (split between the processes)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2, help="threads of the whole machine, split between processes")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the data and store (default: a temporary one)")
    p.add_argument("--worker", metavar="STORE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.steps)
    with work_folder(args.work, "bench-input-dist-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    from pipeline.config import compose_run_config
    from pipeline.data.sources import prepare_store

    cfg = compose_run_config([f"data.synthetic.rows={args.rows}", f"paths.cache_dir={work / 'cache'}"])
    store = prepare_store(cfg.data, cfg.paths.cache_dir)
    results: dict[int, list[dict]] = {n: [] for n in args.procs}
    for r in range(args.repeats):
        for n in args.procs:
            env = child_env({"OMP_NUM_THREADS": str(max(1, args.threads // n))})
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   str(Path(__file__).resolve()), "--worker", str(store.root), "--batch", str(args.batch), "--steps", str(args.steps)]
            print(f"round {r + 1}/{args.repeats}: {n} process(es)", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"torchrun of {n} process(es) failed:\n{out.stderr[-3000:]}")
            results[n].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\nDeepFM, global batch {args.batch:,}, {args.steps} steps after 5 warm-up, {args.threads} threads "
          f"in all, median of {args.repeats} rounds\n")
    print("| processes | plain loop samples/s | step ms | input distribution ms | share | samples/s without it |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, rs in results.items():
        def med(key: str) -> float:
            return statistics.median(x[key] for x in rs)
        print(f"| {n} | {med('samples_per_s'):,.0f} | {med('step_ms'):.1f} | {med('input_dist_ms'):.1f} | "
              f"{med('input_dist_ms') / med('step_ms'):.1%} | {med('without_input_dist'):,.0f} |")


if __name__ == "__main__":
    main()
