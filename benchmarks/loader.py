"""The host path alone: training batches from the columnar store to (page-locked) host memory, no model.

    python benchmarks/loader.py --rows 2000000 --batches 4096 65536
    python benchmarks/loader.py --rows 100000 --batches 4096 --model-steps 0      # smoke run

Two ways to feed a step, each timed over ``--seconds`` of batches (epochs repeat) after one warm-up batch:

* ``training thread`` — what training did before (and still does on the CPU): each batch built on the consumer's
  thread (``make_batch``: gather, transpose, a fresh lengths tensor), then, where CUDA is present, copied a second
  time into freshly page-locked memory, and its ids checked;
* ``ring, 2 ahead`` — the GPU path (:mod:`pipeline.data.batch_ring`): a thread gathers each batch straight into one
  of 5 reused (page-locked where CUDA is present) buffers and checks its ids there; the consumer moves it to the
  device (a CUDA copy, asynchronous; on a CPU-only machine a clone of the slot, which also frees it).

Beside them, the model's own rate: ``benchmarks/gpu_profile.py`` at the same batch sizes on the same device (data
already in memory), so a row says whether the host path or the model bounds a step. The synthetic store goes to
``--work`` (default: a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def rate(batches, seconds: float, consume) -> float:
    """Samples per second over ``seconds`` of ``batches()`` (a fresh epoch each time one ends)."""
    samples, start, first = 0, None, True
    while True:
        for batch in batches():
            consume(batch)
            if first:  # the warm-up batch: thread start, first page faults
                first, start = False, time.perf_counter()
                continue
            samples += batch.labels.shape[0]
            if time.perf_counter() - start >= seconds:
                return samples / (time.perf_counter() - start)


def model_rates(device: str, batches: list[int], steps: int, work: Path) -> dict[int, float]:
    """``gpu_profile.py``'s samples/s per batch size (the model alone, data in memory)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--device", device,
                          "--rows", str(max(batches) * 3), "--batches", *map(str, batches), "--steps", str(steps),
                          "--warmup", "1", "--profile-batch", str(min(batches))],
                         cwd=work, env=child_env(), capture_output=True, text=True, check=True).stdout
    return {int(b.replace(",", "")): float(s.replace(",", "")) for b, s in re.findall(r"^\| ([\d,]+) \| ([\d,]+) \|",
                                                                                      out, re.M)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="rows of the synthetic log")
    p.add_argument("--batches", type=int, nargs="+", default=[4096, 65536])
    p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per case")
    p.add_argument("--model-steps", type=int, default=3, help="gpu_profile steps per batch size (0: skip the model)")
    p.add_argument("--work", default=None, help="folder for the synthetic store (default: a temporary one)")
    args = p.parse_args()

    from modules.embedding.lookup_inputs import check_ids
    from pipeline.config import compose_run_config
    from pipeline.data.batches import BatchLoader
    from pipeline.data.datamodule import CTRDataModule

    with work_folder(args.work, "bench-loader-") as work:
        cfg = compose_run_config([f"data.synthetic.rows={args.rows}", f"paths.cache_dir={work / 'cache'}"])
        data = CTRDataModule(cfg.data, cfg.paths.cache_dir, 4096, 4096, cfg.seed)
        data.prepare_data()
        data.setup()
        spec = data.feature_spec
        arrays = data.store.split("train")
        keys = spec.kjt_keys
        table_rows = [spec.table_sizes[spec.table_of(f)] for f in keys]
        cuda = torch.cuda.is_available()
        device = torch.device("cuda" if cuda else "cpu")
        rows_t = torch.tensor(table_rows)
        models = model_rates(device.type, args.batches, args.model_steps, work) if args.model_steps else {}
        print(f"\n{cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; "
              f"{len(arrays):,} training rows, {len(keys)} id features; device {device} "
              f"({'page-locked buffers' if cuda else 'no CUDA: pageable buffers, the ring batch cloned out of its slot'})\n")
        print("| batch | path | samples/s | ms/batch | model alone, samples/s | host path / model |")
        print("|---:|---|---:|---:|---:|---:|")
        for b in args.batches:
            def plain():
                return iter(BatchLoader(arrays, keys, b, 0, 1, True, cfg.seed, pin_memory=cuda))

            def plain_step(batch) -> None:  # the old transfer hook: the ids checked on the training thread, copied
                check_ids(batch.sparse_features, rows_t)
                batch.to(device, non_blocking=True)

            def ring():
                return iter(BatchLoader(arrays, keys, b, 0, 1, True, cfg.seed, pin_memory=cuda, background=True,
                                        table_rows=table_rows))

            for name, batches, consume in (("training thread", plain, plain_step),
                                           ("ring, 2 ahead", ring, lambda batch: batch.to(device, non_blocking=True))):
                r = rate(batches, args.seconds, consume)
                if cuda:
                    torch.cuda.synchronize()
                m = models.get(b)
                print(f"| {b:,} | {name} | {r:,.0f} | {b / r * 1e3:.2f} | {f'{m:,.0f}' if m else '-'} | "
                      f"{f'{r / m:.1f}×' if m else '-'} |", flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
