"""The GPU path end to end, as a new user runs it: one command, a report per stage.

    python benchmarks/gpu_check.py --device cuda --out gpu_check        # one GPU (≤ 8 minutes on an H200)
    python benchmarks/gpu_check.py --device cpu --out gpu_check_cpu     # the same stages at small sizes (CI)

Writes ``OUT/report.json`` after every stage (one entry per stage: status ok | failed | refused | skipped, seconds,
samples/s, test AUC, peak memory, the error's last lines) and ``OUT/log.txt`` (every command and what it printed).
Stages, each a real ``ctr`` command in its own process:

1. ``imports`` — torch, torchrec, fbgemm-gpu, lightning: versions, the device;
2. ``train`` — ``ctr train topology=1gpu`` on the default synthetic log; on CUDA also the same config and seed on the
   CPU (``train_cpu``): the AUC difference;
3. ``uvm_cache`` — the largest table behind a GPU cache of 10 % of its rows (``cache_load_factor=0.1``): samples/s
   against ``train``'s (CUDA only);
4. ``ssd`` — a table forced to the ``ssd`` tier on a stated path (on CUDA FBGEMM's KEY_VALUE tables, refused for
   now: docs/gpu.md; on the CPU the file tier);
5. ``batch_65536`` — batch 65,536 with ``scaling=auto`` (8,192 on the CPU);
6. ``gpu_profile`` — ``benchmarks/gpu_profile.py`` at batches 32K and 128K (data in device memory);
7. ``resume_export_predict`` — a run stopped after its first checkpoint, resumed to the end (same MLflow run), exported
   and scored by ``ctr predict`` on the CPU (no GPU visible): the AUC of those scores against the run's.

Peak memory is sampled while each command runs (``nvidia-smi`` on CUDA: the device's memory in use; on the CPU the
process's resident memory). It stops after a stage whose failure makes the rest meaningless (``imports``,
``train``) and says so in the report.
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

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # rows of the synthetic log, training batch, gpu_profile's arguments
    "cuda": {"rows": 1_000_000, "batch": 4096, "large_batch": 65536,
             "profile": ["--rows", "4000000", "--batches", "32768", "131072"]},
    "cpu": {"rows": 40_000, "batch": 1024, "large_batch": 8192,
            "profile": ["--rows", "40000", "--batches", "2048", "--steps", "3", "--warmup", "1", "--profile-batch", "2048"]},
}


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
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / "log.txt").open("w")
        self.report: dict = {"device": args.device, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": []}
        self.size = SIZES[args.device]
        self.common = [f"data.synthetic.rows={args.rows or self.size['rows']}", f"paths.cache_dir={self.out / 'cache'}",
                       f"logger.tracking_uri=sqlite:///{self.out / 'mlflow.db'}", "logger.log_model=false",
                       "trainer.enable_progress_bar=false", f"trainer.batch_size={self.size['batch']}"]

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def run(self, name: str, cmd: list[str], env: dict | None = None, timeout: float = 600) -> tuple[int, str, float]:
        """``cmd`` in its own process: (exit status, what it printed, peak memory in MB)."""
        self.say(f"\n$ {' '.join(cmd)}")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})})
        peak = PeakMemory(self.args.device, proc.pid)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0] + f"\n[{name}: killed after {timeout:.0f} s]"
        self.log.write(output + f"[exit {proc.returncode} after {time.perf_counter() - start:.1f} s]\n")
        self.log.flush()
        return proc.returncode, output, peak.stop()

    def train(self, name: str, overrides: list[str], device: str | None = None) -> dict:
        """A ``ctr train`` run; its result.json and peak memory."""
        folder = self.out / "runs" / name
        topology = "1gpu" if (device or self.args.device) == "cuda" else "cpu"
        env = {"CUDA_VISIBLE_DEVICES": ""} if topology == "cpu" else None
        code, output, peak = self.run(name, [sys.executable, "-m", "pipeline.commands.train", f"topology={topology}",
                                             *self.common, *overrides, f"hydra.run.dir={folder}"], env)
        result = folder / "result.json"
        if code != 0 or not result.is_file():
            refused = re.search(r"^Error \((\w+)\): (.*)$", output, re.M)
            return {"status": "refused" if refused else "failed", "peak_memory_mb": peak,
                    "error": refused.group(0) if refused else output[-1500:]}
        r = json.loads(result.read_text())
        return {"status": "ok", "samples_per_s": round(r["samples_per_s"], 1), "test_auc": r["test_auc"],
                "peak_memory_mb": peak, "mlflow_run_id": r["mlflow_run_id"], "output_dir": str(folder)}

    def stage(self, name: str, fn, fatal: bool = False) -> dict:
        self.say(f"\n== {name}")
        start = time.perf_counter()
        try:
            entry = fn()
        except Exception as e:  # noqa: BLE001 - a stage's own failure goes into its entry
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        entry = {"stage": name, **entry, "seconds": round(time.perf_counter() - start, 1)}
        self.report["stages"].append(entry)
        self.say(json.dumps(entry))
        if fatal and entry["status"] != "ok":
            self.report["stopped"] = f"{name} {entry['status']}: the stages after it need it; not run"
            self.say(self.report["stopped"])
        self.write()
        return entry

    def write(self) -> None:
        tmp = self.out / ".report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        os.replace(tmp, self.out / "report.json")


def imports() -> dict:
    import fbgemm_gpu  # noqa: F401
    import lightning
    import torch
    import torchrec

    from importlib.metadata import version
    fbgemm = next((version(p) for p in ("fbgemm-gpu", "fbgemm-gpu-cpu") if _installed(p)), "?")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"status": "ok", "torch": torch.__version__, "torchrec": torchrec.__version__, "fbgemm_gpu": fbgemm,
            "lightning": lightning.__version__, "gpu": gpu}


def _installed(package: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(package)
        return True
    except PackageNotFoundError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", required=True, help="folder for report.json, log.txt and the runs")
    p.add_argument("--rows", type=int, default=None, help="rows of the synthetic log (default: by device)")
    args = p.parse_args()
    check = Check(args)
    cuda = args.device == "cuda"

    entry = check.stage("imports", imports, fatal=True)
    if cuda and entry.get("status") == "ok" and not entry.get("gpu"):
        entry.update(status="failed", error="no CUDA device visible")
        check.report["stopped"] = "imports failed: no GPU"
        check.write()
    if "stopped" in check.report:
        return
    base = check.stage("train", lambda: check.train("train", []), fatal=True)
    if "stopped" in check.report:
        return
    if cuda:
        def against_cpu() -> dict:
            cpu = check.train("train_cpu", [], device="cpu")
            if cpu["status"] == "ok":
                cpu["auc_gpu_minus_cpu"] = round(base["test_auc"] - cpu["test_auc"], 6)
            return cpu
        check.stage("train_cpu", against_cpu)

    def uvm() -> dict:
        if not cuda:
            return {"status": "skipped", "why": "UVM caching is a CUDA kernel"}
        table = "emb_C3"  # the largest synthetic (Criteo-shaped) table
        out = check.train("uvm_cache", [f"+topology.table_overrides.{table}.tier=uvm_cache",
                                        f"+topology.table_overrides.{table}.cache_load_factor=0.1"])
        if out["status"] == "ok":
            out["samples_per_s_vs_hbm"] = round(out["samples_per_s"] / base["samples_per_s"], 3)
        return out
    check.stage("uvm_cache", uvm)

    def ssd() -> dict:
        path = check.out / "ssd"
        return {**check.train("ssd", [f"topology.ssd.path={path}", "+topology.table_overrides.emb_C3.tier=ssd"]),
                "path": str(path)}
    check.stage("ssd", ssd)
    large = check.size["large_batch"]
    check.stage(f"batch_{large}", lambda: check.train(f"batch_{large}", [f"trainer.batch_size={large}", "scaling=auto"]))

    def profile() -> dict:
        code, output, peak = check.run("gpu_profile", [sys.executable, "benchmarks/gpu_profile.py", "--device",
                                                       args.device, *check.size["profile"]])
        rows = re.findall(r"^\| ([\d,]+) \| ([\d,]+) \|", output, re.M)
        if code != 0:
            return {"status": "failed", "error": output[-1500:], "peak_memory_mb": peak}
        return {"status": "ok", "samples_per_s": {b.replace(",", ""): float(s.replace(",", "")) for b, s in rows},
                "peak_memory_mb": peak}
    check.stage("gpu_profile", profile)
    check.stage("resume_export_predict", lambda: resume_export_predict(check))
    check.report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    check.write()


def resume_export_predict(check: Check) -> dict:
    """Stop after the first checkpoint, resume to the end, export, and score raw rows on the CPU."""
    import numpy as np
    import pandas as pd
    from sklearn.metrics import roc_auc_score

    ckpt = check.out / "ckpt"
    half = int(check.args.rows or check.size["rows"]) * 8 // 10 // check.size["batch"] // 2  # half an epoch's steps
    first = check.train("resume_first", [f"trainer.checkpoint.dir={ckpt}", f"trainer.checkpoint.every_n_steps={half}",
                                         f"trainer.max_steps={half}"])
    if first["status"] != "ok":
        return first
    resumed = check.train("resume", [f"trainer.checkpoint.dir={ckpt}", "trainer.resume=auto"])
    if resumed["status"] != "ok":
        return resumed
    same_run = resumed["mlflow_run_id"] == first["mlflow_run_id"]
    exported = check.out / "exported"
    code, output, _ = check.run("export", [sys.executable, "-m", "pipeline.commands.export", f"checkpoint={ckpt}",
                                           f"out={exported}"])
    if code != 0:
        return {"status": "failed", "error": "export: " + output[-1500:]}
    raw = next((check.out / "cache" / "raw").glob("synthetic-*.tsv"))
    rows = check.out / "predict_input.tsv"
    rows.write_text("".join(line for _, line in zip(range(50_000), raw.open())))
    scores = check.out / "scores.csv"
    code, output, _ = check.run("predict", [sys.executable, "-m", "pipeline.commands.predict", f"checkpoint={exported}",
                                            f"input={rows}", f"output={scores}"], env={"CUDA_VISIBLE_DEVICES": ""})
    if code != 0:
        return {"status": "failed", "error": "predict: " + output[-1500:]}
    scored = pd.read_csv(scores)  # probability, and the label the rows carry
    predicted = scored["probability"].to_numpy()
    auc = float(roc_auc_score(scored["label"].to_numpy(), predicted))
    return {"status": "ok" if same_run and np.isfinite(predicted).all() else "failed", "same_mlflow_run": same_run,
            "stopped_after_steps": half, "test_auc_first_part": first["test_auc"], "test_auc": resumed["test_auc"],
            "predict_auc_first_50k_rows": round(auc, 6),
            "predicted_rows": int(len(predicted)), "peak_memory_mb": resumed["peak_memory_mb"]}


if __name__ == "__main__":
    main()
