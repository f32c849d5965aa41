"""DeepFM training throughput on one GPU with the data resident in GPU memory, and where the step goes.

    python benchmarks/gpu_profile.py --rows 10000000 --batches 8192 16384 32768 65536 131072
    python benchmarks/gpu_profile.py --device cpu --rows 200000 --batches 4096 --steps 5   # smoke run

Data: a Criteo-Kaggle-shaped synthetic set generated on the device — the 26 Criteo cardinalities
(``conf/data/criteo_kaggle_shape.yaml``), log-uniform (Zipf-like) ids per field, 13 dense
features, labels from a logistic model of the dense features — kept in GPU memory, so a batch is
a slice (no host→device copy). Model and embedding layer are the project's (``modules.models``,
TorchRec ``DistributedModelParallel`` with FBGEMM's fused embedding optimizer from the 1gpu
topology); the dense part uses Adam. Each batch size trains ``--warmup`` untimed then ``--steps``
timed steps with no host synchronisation inside the loop (CUDA events around it).

Prints per batch size: samples/s, step time and peak GPU memory; then, for ``--profile-batch``,
the share of GPU kernel time by category from ``torch.profiler`` (embedding = FBGEMM TBE
kernels for lookup, backward and the fused optimizer; MLP/interaction = GEMMs and the
element-wise work around them; dense optimizer; other) and the top kernels, so the categories
can be checked by eye; the data step (slicing a batch out of device memory) is timed on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CATEGORIES = (  # first match wins; matched against kernel / operator names
    ("embedding", re.compile(r"embedding|fbgemm|tbe|split_|bounds_check|linearize|lxu|lru|radix|jagged|"
                             r"permute_.*sparse|keyed", re.I)),
    ("dense optimizer", re.compile(r"adam|multi_tensor|foreach|lerp|addcdiv|addcmul|sqrt", re.I)),
    ("mlp / interaction", re.compile(r"gemm|addmm|\bmm\b|matmul|linear|relu|threshold|clamp|sigmoid|cutlass|"
                                     r"sm\d+_|xmma|cat|binary_cross|bce|reduce|sum|sub|mul|add|pow|norm|elementwise|"
                                     r"vectorized", re.I)),
)


def _init_single_process_group(device: torch.device) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


class DeviceData:
    """Criteo-shaped synthetic rows held on ``device``: ids field-major [F, rows], dense [rows, 13]."""

    def __init__(self, table_sizes: list[int], first_id: int, rows: int, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.rows, self.num_fields = rows, len(table_sizes)
        self.ids = torch.empty(len(table_sizes), rows, dtype=torch.int32, device=device)
        for f, size in enumerate(table_sizes):
            n = size - first_id  # vocabulary ids; the rows below first_id are OOV / missing
            u = torch.rand(rows, generator=g, device=device, dtype=torch.float64)
            self.ids[f] = (torch.exp(u * torch.log(torch.tensor(float(n), dtype=torch.float64))).long() - 1) \
                .clamp_(0, n - 1).add_(first_id).to(torch.int32)
        self.dense = torch.log1p(torch.rand(rows, 13, generator=g, device=device) * 100)
        w = torch.randn(13, generator=g, device=device)
        p = torch.sigmoid(self.dense @ w / 4 - 1.0)
        self.labels = torch.bernoulli(p, generator=g)

    def batch(self, start: int, size: int, keys: list[str]):
        from torchrec import KeyedJaggedTensor

        end = start + size
        values = self.ids[:, start:end].reshape(-1)
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones_like(values), stride=size,
                                length_per_key=[size] * self.num_fields,
                                offset_per_key=[i * size for i in range(self.num_fields + 1)])
        return self.dense[start:end], kjt, self.labels[start:end]


def _categorise(prof: profile, device: torch.device) -> tuple[dict[str, float], list[tuple[str, float]]]:
    totals: dict[str, float] = defaultdict(float)
    per_name: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        t = ev.self_device_time_total if device.type == "cuda" else ev.self_cpu_time_total
        if t <= 0 or (device.type == "cuda" and ev.device_type.name != "CUDA"):
            continue
        cat = next((c for c, rx in CATEGORIES if rx.search(ev.key)), "other")
        totals[cat] += t
        per_name.append((ev.key, t))
    return totals, sorted(per_name, key=lambda x: -x[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--batches", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--mlp", type=int, nargs="+", default=[400, 400, 400])
    p.add_argument("--embedding-optimizer", default="rowwise_adagrad", choices=["rowwise_adagrad", "adagrad", "sgd", "adam"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="autocast for the dense part")
    p.add_argument("--profile-batch", type=int, default=65536)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps here")
    args = p.parse_args()

    from dataclasses import replace

    from modules.models import build_model
    from modules.optim.optimizers import replicated_parameters
    from modules.sharding.planner import shard_model
    from modules.sharding.table_stacking import decide_stacking
    from pipeline.commands.plan import spec_and_coverage
    from pipeline.config import compose_run_config
    from pipeline.data.store import FIRST_VOCAB_ID

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    _init_single_process_group(device)
    topology = "1gpu" if device.type == "cuda" else "cpu"
    cfg = compose_run_config([
        "data=criteo_kaggle_shape", f"topology={topology}", f"optim.embedding.name={args.embedding_optimizer}",
        "model=deepfm", f"model.embedding_dim={args.dim}", f"model.mlp=[{','.join(map(str, args.mlp))}]",
        "model.dropout=0.0", "model.batch_norm=false", "model.init_std=0.01"])
    spec, coverage, _ = spec_and_coverage(cfg.data, cfg.paths.cache_dir)
    topology_spec = replace(cfg.topology, ranks_per_node=1)
    model_cfg, _ = decide_stacking(cfg.model, spec, topology_spec, cfg.optim.embedding, coverage)
    net = build_model(model_cfg, spec, device=torch.device("meta"))
    model, plan = shard_model(net, cfg.optim.embedding, topology_spec, device, coverage=coverage)
    dense_params = [q for _, q in replicated_parameters(model)]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3, fused=device.type == "cuda")
    keys = list(spec.categorical)
    tiers = sorted({pl.tier for pl in plan.placements.values()})

    t0 = time.perf_counter()
    data = DeviceData([spec.table_sizes[k] for k in keys], FIRST_VOCAB_ID, args.rows, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    print(f"generated {args.rows:,} Criteo-shaped rows on {device} in {time.perf_counter() - t0:.1f} s; "
          f"embedding tiers: {tiers}", flush=True)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step(i: int, batch: int) -> torch.Tensor:
        start = (i * batch) % (args.rows - batch + 1)
        with record_function("data"):
            dense, kjt, labels = data.batch(start, batch, keys)
        with record_function("forward"), amp:
            loss = F.binary_cross_entropy_with_logits(model(dense, kjt).float(), labels)
        with record_function("backward"):  # includes the fused embedding update
            loss.backward()
        with record_function("dense_optimizer"):
            dense_opt.step()
            dense_opt.zero_grad(set_to_none=True)
        return loss.detach()

    print(f"\nDeepFM dim {args.dim}, MLP {args.mlp}, embedding optimizer {args.embedding_optimizer} (fused), "
          f"dense Adam, {args.precision}, {device}\n")
    print("| batch | samples/s | ms/step | peak memory GiB | last loss |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for i in range(args.warmup):
            step(i, batch)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for i in range(args.steps):
            loss = step(args.warmup + i, batch)
        sync()
        dt = (time.perf_counter() - t) / args.steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(f"| {batch:,} | {batch / dt:,.0f} | {dt * 1e3:.2f} | {peak:.2f} | {loss.item():.4f} |", flush=True)

    batch = args.profile_batch
    sync()
    t = time.perf_counter()
    for i in range(args.steps):
        data.batch((i * batch) % (args.rows - batch + 1), batch, keys)
    sync()
    data_ms = (time.perf_counter() - t) / args.steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for i in range(3):
        step(i, batch)
    sync()
    with profile(activities=activities) as prof:
        for i in range(10):
            step(i, batch)
        sync()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    totals, kernels = _categorise(prof, device)
    total = sum(totals.values()) or 1.0
    what = "GPU kernel" if device.type == "cuda" else "CPU operator self"
    print(f"\nShare of {what} time at batch {batch:,} (10 steps; data = batch slicing, timed alone: "
          f"{data_ms:.3f} ms/batch):\n")
    print("| category | ms/step | share |")
    print("|---|---:|---:|")
    for cat in [c for c, _ in CATEGORIES] + ["other"]:
        print(f"| {cat} | {totals.get(cat, 0.0) / 1e3 / 10:.2f} | {100 * totals.get(cat, 0.0) / total:.1f} % |")
    print("\nTop kernels:\n\n| kernel | ms/step | category |\n|---|---:|---|")
    for name, t in kernels[:15]:
        cat = next((c for c, rx in CATEGORIES if rx.search(name)), "other")
        print(f"| {name[:90]} | {t / 1e3 / 10:.3f} | {cat} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
