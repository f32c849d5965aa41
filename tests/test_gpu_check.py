"""The device run, rehearsed on the CPU: the command docs/gpu.md gives for a lent GPU machine, run as it runs there.

There the stack is unpacked into a folder that ``PYTHONPATH`` names and the checkout is not installed, and the
machine returns at most 8 files of its output folder, no more than 2 folders down. Here: a copy of the checkout's
files (no ``ctr_conf`` package, no editable finder), run by the base interpreter with the venv's site-packages as
``PYTHONPATH`` (``.pth`` files there are not read: nothing of the install runs), ``--device cpu`` and small sizes.
"""

from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

STAGES = ["imports", "train", "train_bf16", "gpu_profile", "uvm_cache", "batch_8192", "cowclip_l2_init_from", "ssd",
          "fp16_rows"]


def device_command() -> str:
    """The check's command line from docs/gpu.md's device call (the part after the unpacking)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    line = next(x for x in text.splitlines() if "benchmarks/gpu_check.py --device cuda" in x and "unpack.sh" in x)
    return line[line.index("PYTHONPATH="):].strip()


def uninstalled_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore) copied to ``dest``: not installed."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def rehearsal_env(checkout: Path) -> dict[str, str]:
    """A bare environment as on the device: no venv active, no PYTHONPATH but the one the command sets."""
    import os
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "USER")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "OMP_NUM_THREADS": "1"}


def test_the_documented_device_run_rehearsed_on_the_cpu(tmp_path):
    checkout = uninstalled_copy(tmp_path / "checkout")
    assert not (checkout / "ctr_conf").exists()
    packages = site.getsitepackages()[0]  # the venv's: it stands for /tmp/site
    python = getattr(sys, "_base_executable", sys.executable)  # not the venv's: nothing of the install runs
    out = tmp_path / "OUT"
    command = device_command()
    assert "/tmp/site:$PWD" in command and "--report $OUT" in command and "--deadline" in command
    command = (command.replace("/tmp/site", packages).replace("$PWD", str(checkout)).replace("$OUT", str(out))
               .replace("--device cuda", "--device cpu").replace("python3 ", f"{python} ", 1))
    proc = subprocess.run(["bash", "-c", command], cwd=checkout, env=rehearsal_env(checkout), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    # what a lent machine returns: report.json and log.txt, nothing else (at most 8 files, 2 folders down)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["log.txt", "report.json"]
    assert all(p.stat().st_size < 16 << 20 for p in out.iterdir())
    report = json.loads((out / "report.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == STAGES and report["failed"] == [] and "stopped" not in report, report
    assert all(s["status"] == "ok" for s in stages.values()), stages
    imports = stages["imports"]
    assert imports["configs"] == str(checkout / "conf")  # composed from the checkout's folder: no ctr_conf installed
    assert imports["tbe_max_error"]["fused"] < 1e-5
    train, bf16, uvm = stages["train"], stages["train_bf16"], stages["uvm_cache"]
    assert 0.7 < train["test_auc"] < 1 and train["samples_per_s_after_warmup"] > 0 and train["warmup_s"] > 0
    assert abs(bf16["test_auc"] - train["test_auc"]) < 0.003
    # stopped at a checkpoint, resumed into the same MLflow run: on the CPU it ends where the uninterrupted run does;
    # its logged model, reloaded by ctr predict, scores the test split's raw rows to the run's test AUC
    assert uvm["same_mlflow_run"] and uvm["auc_resumed_minus_uninterrupted"] == 0
    assert uvm["test_auc"] == train["test_auc"]
    assert abs(uvm["predict_auc"] - uvm["test_auc"]) <= 1e-5 and 3000 < uvm["predicted_rows"] < 5000  # ~10 % of 40k
    assert abs(stages["ssd"]["test_auc"] - train["test_auc"]) < 1e-5  # the file tier trains the same model
    assert stages["gpu_profile"]["samples_per_s"]["2048"] > 0
    assert 0.5 < stages["cowclip_l2_init_from"]["test_auc"] < 1
    fp16 = stages["fp16_rows"]  # the rows in fp16: the same model within AUC_VS_CPU, its tables ~0.5× as planned
    assert abs(fp16["auc_minus_fp32_rows"]) < 0.003 and 0.4 < fp16["table_mib"] / train["table_mib"] < 0.6
    log = (out / "log.txt").read_text()
    assert "RESULT test_auc=" in log and "ModuleNotFoundError" not in log


def test_a_deadline_cuts_the_check_names_what_it_skipped_and_fails(tmp_path):
    """``--deadline 0``: nothing runs, every stage is named as skipped, and the exit status says the check is
    incomplete; a deadline inside the first stage kills its command, and the rest are named as skipped."""
    none = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--deadline", "0",
                           "--report", str(tmp_path / "none")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert none.returncode == 1, none.stdout + none.stderr
    report = json.loads((tmp_path / "none" / "report.json").read_text())
    assert report["skipped_for_deadline"] == STAGES
    assert [s["status"] for s in report["stages"]] == ["skipped"] * len(STAGES)
    cut = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--deadline", "2",
                          "--report", str(tmp_path / "cut")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cut.returncode == 1, cut.stdout + cut.stderr
    report = json.loads((tmp_path / "cut" / "report.json").read_text())
    first, *rest = report["stages"]
    assert first["stage"] == "imports" and first["status"] == "failed" and first["seconds"] < 30
    assert [s["stage"] for s in rest] == STAGES[1:] and {s["status"] for s in rest} == {"skipped"}
    assert re.search(r"killed after \d+ s", (tmp_path / "cut" / "log.txt").read_text())
