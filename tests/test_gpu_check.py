"""``benchmarks/gpu_check.py --device cpu``: the GPU check's stages at small sizes, so that the script a GPU session
runs cannot rot in between (CI has no GPU)."""

from __future__ import annotations

import json
import sqlite3
import subprocess

from tests.conftest import PYTHON, ROOT, subprocess_env


def test_gpu_check_runs_every_stage_on_the_cpu_and_reports_each(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([PYTHON, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(out)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == ["imports", "train", "uvm_cache", "ssd", "batch_8192", "gpu_profile",
                            "resume_export_predict"] and "stopped" not in report and "finished" in report
    assert stages["uvm_cache"]["status"] == "skipped"  # a CUDA kernel
    assert all(s["status"] == "ok" for name, s in stages.items() if name != "uvm_cache"), stages
    train, ssd, resumed = stages["train"], stages["ssd"], stages["resume_export_predict"]
    assert 0.7 < train["test_auc"] < 1 and train["samples_per_s"] > 0 and train["peak_memory_mb"] > 100
    # the file tier trains the same model as host memory; a run stopped half-way and resumed ends where the
    # uninterrupted one does (the same MLflow run), and its export scores on the CPU
    assert abs(ssd["test_auc"] - train["test_auc"]) < 1e-5 and ssd["path"] == str(out / "ssd")
    assert resumed["same_mlflow_run"] and resumed["test_auc"] == train["test_auc"]
    assert resumed["test_auc_first_part"] != train["test_auc"] and resumed["predicted_rows"] == 40_000
    assert 0.7 < resumed["predict_auc_first_50k_rows"] < 1
    assert stages["gpu_profile"]["samples_per_s"]["2048"] > 0
    # the resumed run changed trainer.max_steps: the first value stays the parameter, the new one is a tag, and no
    # logging call was refused (none left in a fallback store)
    with sqlite3.connect(out / "mlflow.db") as db:
        run = stages["train"]["mlflow_run_id"]  # (a query on the resumed run's id below)
        rid = json.loads((out / "runs" / "resume" / "result.json").read_text())["mlflow_run_id"]
        params = dict(db.execute("select key, value from params where run_uuid=?", (rid,)))
        tags = dict(db.execute("select key, value from tags where run_uuid=?", (rid,)))
    assert run != rid and params["trainer/max_steps"] == str(resumed["stopped_after_steps"])
    assert tags["resumed/trainer/max_steps"] == "-1"
    assert not (out / "runs" / "resume" / "mlflow_fallback.db").exists()
    log = (out / "log.txt").read_text()
    assert "$ " in log and "RESULT test_auc=" in log
