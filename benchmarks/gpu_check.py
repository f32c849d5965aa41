"""The GPU path end to end, as a new user runs it: one command, a report per stage, within a deadline.

    python benchmarks/gpu_check.py --device cuda --deadline 480 --report gpu_report    # one GPU (docs/gpu.md)
    python benchmarks/gpu_check.py --device cpu --report gpu_report_cpu                # the same stages, small (CI)

``--report DIR`` receives two files only, ``report.json`` (rewritten after every stage) and ``log.txt`` (every command
and what it printed): what a lent machine's output folder returns (at most 8 files, 2 folders down). Everything else
(the synthetic log, its store, the MLflow store, checkpoints, model folders) goes to ``--work DIR``, by default a
temporary folder removed at the end; the commands run there (MLflow puts a run's artifacts under the folder it is
started in). Each stage is a real ``ctr`` command in its own process, with this process's
``PYTHONPATH`` extended by the checkout (never replaced: on a device machine it names the unpacked stack), and ends
within its own limit and the ``--deadline`` (seconds from the start); stages left when the deadline passes, or
after a stage the rest need fails, are named as skipped. The exit status is 1 when any stage failed or was skipped
for the deadline.

1. ``imports`` — ``benchmarks/gpu_check_imports.py`` as a child: every package and the configs, one forward/backward
   of a row-wise Adagrad TBE on each compute kernel (``fused``; on CUDA ``fused_uvm_caching``) against its formula;
2. ``train`` — ``ctr train`` (``topology=1gpu`` on CUDA) on the default synthetic log, fp32; ``train_bf16`` the
   same in ``bf16-mixed``; on CUDA ``train_cpu``, the same config and seed on the CPU: each GPU AUC within
   ``AUC_VS_CPU`` of it;
3. ``gpu_profile`` — ``benchmarks/gpu_profile.py`` (data in device memory): the model's own rate;
4. ``uvm_cache`` — the largest table behind a GPU cache of 10 % of its rows (on the CPU: host memory, the same
   steps): stopped at its first checkpoint, resumed to the end with its model logged from the live shards (ending
   within ``AUC_RESUMED`` of ``train``'s AUC), the model reloaded by ``ctr predict`` on the CPU and scored on the raw
   rows of the test split: that AUC equals the run's ``test_auc`` (within ``AUC_PREDICT``);
5. ``batch_<large>`` — batch 65,536 (8,192 on the CPU) with ``scaling=auto``;
6. ``cowclip_l2_init_from`` — ``scaling=cowclip``, the embedding L2 term and ``trainer.init_from`` the model of 4;
7. ``ssd`` — a table forced to the ``ssd`` tier on a stated path (refused on CUDA for now: docs/gpu.md);
8. ``fp16_rows`` — ``train`` with ``model.table_precision=fp16``: its AUC within ``AUC_VS_CPU`` of ``train``'s (each
   training stage reports its planned ``table_mib``) (on the CPU FBGEMM's fp16 lookup is slow: docs/throughput.md; on CUDA the usual path).

samples/s are reported after each run's warm-up steps (``samples_per_s_after_warmup``), their time beside them.
Peak memory is sampled while each command runs (``nvidia-smi`` on CUDA; on the CPU the process's resident memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from work_folder import ROOT, child_env, work_folder  # beside this file

SIZES = {  # rows of the synthetic log, training batch, the large batch, gpu_profile's arguments
    "cuda": {"rows": 1_000_000, "batch": 4096, "large_batch": 65536,
             "profile": ["--rows", "4000000", "--batches", "65536", "131072", "--steps", "30"]},
    "cpu": {"rows": 40_000, "batch": 1024, "large_batch": 8192,
            "profile": ["--rows", "20000", "--batches", "2048", "--steps", "2", "--warmup", "1", "--profile-batch", "2048",
                        "--dim", "4", "--mlp", "64"]},
}
STAGE_LIMIT_S = 240        # one command's most
AUC_VS_CPU = 0.003         # a GPU run's test AUC against the same run on the CPU
AUC_RESUMED = 1e-4         # a run stopped and resumed against the uninterrupted one
AUC_PREDICT = 1e-5         # ctr predict's AUC on the test split's raw rows against the run's test_auc


class PeakMemory:
    """The largest memory in use while a command runs, sampled every 0.2 s: the GPU's (``nvidia-smi``) or the
    process's resident set (``/proc``)."""

    def __init__(self, device: str, pid: int) -> None:
        self.device, self.pid, self.peak_mb, self._stop = device, pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> float:
        if self.device == "cuda":
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0]) if out.strip() else 0.0
        status = Path(f"/proc/{self.pid}/status").read_text()
        return float(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_mb = max(self.peak_mb, self._sample())
            except (OSError, ValueError, AttributeError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.2)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak_mb, 1)


class Check:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.device = args, args.device
        self.report_dir = Path(args.report).resolve()
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.deadline = time.monotonic() + args.deadline
        self.log = (self.report_dir / "log.txt").open("w")
        self.report: dict = {"device": args.device, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "deadline_s": args.deadline, "stages": []}
        self.size = SIZES[args.device]
        self.common = [f"data.synthetic.rows={args.rows or self.size['rows']}", f"paths.cache_dir={self.work / 'cache'}",
                       f"logger.tracking_uri=sqlite:///{self.work / 'mlflow.db'}", "logger.log_model=false",
                       "trainer.enable_progress_bar=false", f"trainer.batch_size={self.size['batch']}"]
        self.results: dict[str, dict] = {}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def run(self, name: str, cmd: list[str], env: dict | None = None) -> tuple[int, str, float]:
        """``cmd`` in its own process, within the stage limit and the deadline: (exit status, output, peak MB)."""
        limit = max(1.0, min(STAGE_LIMIT_S, self.remaining()))
        self.say(f"\n$ {' '.join(cmd)}")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=self.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env({"PYTHONUNBUFFERED": "1", **(env or {})}))
        peak = PeakMemory(self.device, proc.pid)
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0] + f"\n[{name}: killed after {limit:.0f} s (stage limit or deadline)]"
        self.log.write(output + f"[exit {proc.returncode} after {time.perf_counter() - start:.1f} s]\n")
        self.log.flush()
        return proc.returncode, output, peak.stop()

    def train(self, name: str, overrides: list[str], device: str | None = None) -> dict:
        """A ``ctr train`` run in ``<work>/runs/<name>``: its result.json and peak memory."""
        folder = self.work / "runs" / name
        topology = "1gpu" if (device or self.device) == "cuda" else "cpu"
        env = {"CUDA_VISIBLE_DEVICES": ""} if topology == "cpu" else None
        code, output, peak = self.run(name, [sys.executable, "-m", "pipeline.commands.train", f"topology={topology}",
                                             *self.common, *overrides, f"hydra.run.dir={folder}"], env)
        result = folder / "result.json"
        if code != 0 or not result.is_file():
            refused = re.search(r"^Error \((\w+)\): (.*)$", output, re.M)
            return {"status": "refused" if refused else "failed", "peak_memory_mb": peak,
                    "error": refused.group(0) if refused else output[-1500:]}
        r = json.loads(result.read_text())
        out = {"status": "ok", "test_auc": r["test_auc"], "samples_per_s": round(r["samples_per_s"], 1),
               "samples_per_s_after_warmup": r.get("samples_per_s_after_warmup") and
               round(r["samples_per_s_after_warmup"], 1), "warmup_s": r.get("warmup_s") and round(r["warmup_s"], 2),
               "peak_memory_mb": peak, "table_mib": r.get("table_bytes") and round(r["table_bytes"] / 2**20, 1),
               "mlflow_run_id": r["mlflow_run_id"], "output_dir": str(folder)}
        self.results[name] = out
        return out

    def run_all(self, stages: list[tuple[str, Callable[[], dict], bool]]) -> None:
        """Each stage in turn; after the deadline, or after a stage the rest need fails, the rest are named as
        skipped, with why."""
        for name, fn, fatal in stages:
            if "stopped" in self.report or self.remaining() <= 0:
                why = self.report.get("stopped") or f"the deadline ({self.args.deadline:.0f} s) passed"
                if "stopped" not in self.report:
                    self.report.setdefault("skipped_for_deadline", []).append(name)
                self.record({"stage": name, "status": "skipped", "why": why})
                continue
            self.say(f"\n== {name} ({self.remaining():.0f} s left)")
            start = time.perf_counter()
            try:
                entry = fn()
            except Exception as e:  # noqa: BLE001 - a stage's own failure goes into its entry
                entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            self.record({"stage": name, **entry, "seconds": round(time.perf_counter() - start, 1)})
            if fatal and entry["status"] != "ok":
                self.report["stopped"] = f"{name} {entry['status']}: the stages after it need it; not run"
                self.say(self.report["stopped"])

    def record(self, entry: dict) -> None:
        self.report["stages"].append(entry)
        self.say(json.dumps(entry))
        self.write()

    def write(self) -> None:
        tmp = self.report_dir / ".report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        os.replace(tmp, self.report_dir / "report.json")

    def finish(self) -> int:
        failed = [s["stage"] for s in self.report["stages"] if s["status"] == "failed"]
        self.report.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"), failed=failed)
        self.write()
        self.say(f"\nfailed: {', '.join(failed) or 'none'}; skipped for the deadline: "
                 f"{', '.join(self.report.get('skipped_for_deadline', [])) or 'none'}; report: {self.report_dir}")
        self.log.close()
        return 1 if failed or "stopped" in self.report or "skipped_for_deadline" in self.report else 0


def within(entry: dict, key: str, value: float, reference: float, tolerance: float) -> dict:
    """``entry`` with ``key`` = value − reference; failed where |value − reference| > tolerance."""
    entry[key] = round(value - reference, 6)
    if abs(value - reference) > tolerance and entry["status"] == "ok":
        entry.update(status="failed", error=f"{key} = {entry[key]}: beyond ±{tolerance}")
    return entry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--report", required=True, help="folder for report.json and log.txt, and nothing else")
    p.add_argument("--work", default=None, help="folder for data, stores, checkpoints (default: a temporary one, "
                                                 "removed at the end)")
    p.add_argument("--deadline", type=float, default=480, help="seconds from the start; later stages are skipped")
    p.add_argument("--rows", type=int, default=None, help="rows of the synthetic log (default: by device)")
    args = p.parse_args()
    from gpu_check_stages import stages  # beside this file
    with work_folder(args.work, "gpu-check-") as work:
        check = Check(args, work)
        try:
            check.run_all(stages(check))
        finally:
            code = check.finish()
    sys.exit(code)


if __name__ == "__main__":
    main()
