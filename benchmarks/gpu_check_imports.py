"""The ``imports`` stage of ``benchmarks/gpu_check.py``, run as a child with the environment every later stage gets.

    python benchmarks/gpu_check_imports.py --device cuda|cpu        # prints one JSON line, exits 1 on any failure

1. every package a ``ctr`` command imports (torch, torchrec, fbgemm-gpu, lightning, hydra, omegaconf, mlflow) and the
   project's own configs, composed as the commands compose them (``pkg://ctr_conf``, or the checkout's ``conf/``);
2. one forward and backward of a small row-wise Adagrad table batch (FBGEMM's TBE) on each compute kernel the planner
   can choose on the device — ``fused`` (rows in device memory; host memory on the CPU) and, on CUDA,
   ``fused_uvm_caching`` (rows in UVM behind a device cache) — checked against the formulas:

       forward:   out_b = Σ_{i ∈ bag b} w_{id_i}                                     (sum pooling)
       backward:  G_r = Σ_{i: id_i = r} g_{bag(i)};  s_r = mean_j(G_r,j²);  w_r ← w_r − lr · G_r / (√s_r + ε)

   A kernel missing from a thinned FBGEMM build fails here in seconds, before any data is prepared.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version


def package_version(*names: str) -> str:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


def tbe_check(device: str, kernel: str) -> float:
    """One step of a 2-table row-wise Adagrad TBE on ``kernel``; the largest deviation from the formulas above."""
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice, OptimType,
                                                                       SplitTableBatchedEmbeddingBagsCodegen)

    location = {"fused": EmbeddingLocation.HOST if device == "cpu" else EmbeddingLocation.DEVICE,
                "fused_uvm_caching": EmbeddingLocation.MANAGED_CACHING}[kernel]
    compute = ComputeDevice.CPU if device == "cpu" else ComputeDevice.CUDA
    rows, dim, lr, eps = (1000, 500), 16, 0.05, 1e-8
    extra = {"cache_load_factor": 0.1} if kernel == "fused_uvm_caching" else {}
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(n, dim, location, compute) for n in rows],
                                                optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps,
                                                pooling_mode=PoolingMode.SUM, **extra)
    g = torch.Generator().manual_seed(0)
    for w in tbe.split_embedding_weights():
        w.copy_(torch.randn(w.shape, generator=g) * 0.1)
    before = [w.detach().cpu().clone() for w in tbe.split_embedding_weights()]
    batch = 64
    lengths = torch.randint(1, 4, (len(rows) * batch,), generator=g)  # table-major: all bags of table 0, then 1
    ids = torch.cat([torch.randint(0, rows[t], (int(n),), generator=g)
                     for t, n in enumerate(lengths.view(len(rows), batch).sum(1))])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    out = tbe(ids.to(device), offsets.to(device))  # [B, T·D]
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad.to(device))
    after = [w.detach().cpu() for w in tbe.split_embedding_weights()]
    # the reference, in float64 on the host
    bag_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    table_of = bag_of // batch
    want_out = torch.zeros(batch, len(rows) * dim, dtype=torch.float64)
    sums = [torch.zeros(n, dim, dtype=torch.float64) for n in rows]
    for i, (t, b) in enumerate(zip(table_of.tolist(), (bag_of % batch).tolist())):
        want_out[b, t * dim:(t + 1) * dim] += before[t][ids[i]].double()
        sums[t][ids[i]] += grad[b, t * dim:(t + 1) * dim].double()
    worst = float((out.detach().cpu().double() - want_out).abs().max())
    for t in range(len(rows)):
        s = (sums[t] ** 2).mean(dim=1, keepdim=True)
        want = before[t].double() - lr * sums[t] / (s.sqrt() + eps)
        worst = max(worst, float((after[t].double() - want).abs().max()))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    found: dict = {"status": "ok"}
    try:
        import fbgemm_gpu  # noqa: F401
        import hydra
        import lightning
        import mlflow
        import omegaconf
        import torch
        import torchrec

        from pipeline.config import compose_run_config
        from pipeline.runtime.config_source import config_path

        found.update(torch=torch.__version__, torchrec=torchrec.__version__, lightning=lightning.__version__,
                     fbgemm_gpu=package_version("fbgemm-gpu", "fbgemm-gpu-cpu"), hydra=hydra.__version__,
                     omegaconf=omegaconf.__version__, mlflow=mlflow.__version__, python=sys.version.split()[0])
        found["configs"] = config_path()
        found["default_model"] = compose_run_config([]).model.name
        if args.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device visible")
            found["gpu"] = torch.cuda.get_device_name(0)
            found["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        kernels = ["fused"] + (["fused_uvm_caching"] if args.device == "cuda" else [])
        found["tbe_max_error"] = {k: tbe_check(args.device, k) for k in kernels}
        bad = {k: e for k, e in found["tbe_max_error"].items() if not e < 1e-4}
        if bad:
            raise RuntimeError(f"row-wise Adagrad TBE off its formulas on {bad}")
    except Exception as e:  # noqa: BLE001 - reported as the stage's failure
        found.update(status="failed", error=f"{type(e).__name__}: {e}")
    print(json.dumps(found), flush=True)
    sys.exit(0 if found["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
