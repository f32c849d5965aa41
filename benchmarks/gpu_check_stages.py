"""The stages of ``benchmarks/gpu_check.py`` (its docstring says what each checks), in the order a lease
is best spent: what proves the path first, then the figures, then the rest."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from gpu_check import AUC_PREDICT, AUC_RESUMED, AUC_VS_CPU, ROOT, Check, within

LARGEST_TABLE = "emb_C3"  # of the synthetic (Criteo-shaped) log


def stages(check: Check) -> list[tuple[str, Callable[[], dict], bool]]:
    """(name, what it runs, whether the stages after it need it) of every stage, in order."""
    cuda = check.device == "cuda"
    large = check.size["large_batch"]
    return [
        ("imports", lambda: imports(check), True),
        ("train", lambda: check.train("train", ["trainer.precision=32-true"]), True),
        ("train_bf16", lambda: check.train("train_bf16", ["trainer.precision=bf16-mixed"]), False),
        *([("train_cpu", lambda: against_cpu(check), False)] if cuda else []),
        ("gpu_profile", lambda: profile(check), False),
        ("uvm_cache", lambda: uvm_cache(check, check.results["train"]), False),
        (f"batch_{large}", lambda: check.train(f"batch_{large}", [f"trainer.batch_size={large}", "scaling=auto",
                                                                  "trainer.precision=32-true"]), False),
        ("cowclip_l2_init_from", lambda: cowclip_l2_init_from(check), False),
        ("ssd", lambda: ssd(check), False),
        ("fp16_rows", lambda: fp16_rows(check), False),
    ]


def imports(check: Check) -> dict:
    """``gpu_check_imports.py`` in a child with the children's environment; its JSON line."""
    code, output, _ = check.run("imports", [sys.executable, str(ROOT / "benchmarks" / "gpu_check_imports.py"), "--device", check.device])
    found = [line for line in output.splitlines() if line.startswith("{")]
    if not found:
        return {"status": "failed", "error": output[-1500:]}
    entry = json.loads(found[-1])
    if code != 0 and entry.get("status") == "ok":
        entry.update(status="failed", error=f"exit {code}")
    return entry


def against_cpu(check: Check) -> dict:
    """The ``train`` config and seed on the CPU; each GPU precision's AUC against it."""
    cpu = check.train("train_cpu", ["trainer.precision=32-true"], device="cpu")
    if cpu["status"] == "ok":
        for name in ("train", "train_bf16"):
            if check.results.get(name, {}).get("status") == "ok":
                within(cpu, f"auc_{name}_minus_cpu", check.results[name]["test_auc"], cpu["test_auc"], AUC_VS_CPU)
    return cpu


def profile(check: Check) -> dict:
    code, output, peak = check.run("gpu_profile", [sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--device",
                                                   check.device, *check.size["profile"]])
    if code != 0:
        return {"status": "failed", "error": output[-1500:], "peak_memory_mb": peak}
    import re
    rows = re.findall(r"^\| ([\d,]+) \| ([\d,]+) \|", output, re.M)
    return {"status": "ok", "samples_per_s": {b.replace(",", ""): float(s.replace(",", "")) for b, s in rows},
            "peak_memory_mb": peak}


def uvm_cache(check: Check, base: dict) -> dict:
    """Stopped at its first checkpoint, resumed with its model logged, the model reloaded and scored."""
    cuda = check.device == "cuda"
    tier = [f"+topology.table_overrides.{LARGEST_TABLE}.tier=uvm_cache",
            f"+topology.table_overrides.{LARGEST_TABLE}.cache_load_factor=0.1"] if cuda else []
    ckpt = check.work / "ckpt_uvm"
    rows = int(check.args.rows or check.size["rows"])
    half = rows * 85 // 100 // check.size["batch"] // 2  # half an epoch's steps (85 % of the rows train)
    common = [*tier, "trainer.precision=32-true", f"trainer.checkpoint.dir={ckpt}"]
    first = check.train("uvm_first", [*common, f"trainer.checkpoint.every_n_steps={half}", f"trainer.max_steps={half}"])
    if first["status"] != "ok":
        return first
    resumed = check.train("uvm_cache", [*common, "trainer.resume=auto", "logger.log_model=true"])
    if resumed["status"] != "ok":
        return resumed
    entry = {**resumed, "tier": f"uvm_cache (10 % of {LARGEST_TABLE})" if cuda else "host memory (no UVM on a CPU)",
             "stopped_after_steps": half, "same_mlflow_run": resumed["mlflow_run_id"] == first["mlflow_run_id"]}
    if not entry["same_mlflow_run"]:
        entry.update(status="failed", error="the resumed run logged into another MLflow run")
    within(entry, "auc_resumed_minus_uninterrupted", resumed["test_auc"], base["test_auc"], AUC_RESUMED)
    steady, hbm = resumed.get("samples_per_s_after_warmup"), base.get("samples_per_s_after_warmup")
    if steady and hbm:
        entry["samples_per_s_vs_hbm"] = round(steady / hbm, 3)
    predicted = predict_test_split(check, Path(resumed["output_dir"]))
    entry.update({k: v for k, v in predicted.items() if k != "status"})
    if predicted["status"] != "ok" and entry["status"] == "ok":
        entry["status"] = "failed"
    if "predict_auc" in predicted:
        within(entry, "predict_auc_minus_test_auc", predicted["predict_auc"], resumed["test_auc"], AUC_PREDICT)
    return entry


def predict_test_split(check: Check, run_dir: Path) -> dict:
    """``ctr predict`` of the run's model folder (on the CPU: no GPU visible) on the raw rows of its test split."""
    from pipeline.data.pass1 import SPLIT_CODES, assign_splits
    from pipeline.data.preprocess_config import SplitConfig

    split = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["data"]["preprocess"]["split"]
    raw = next((check.work / "cache" / "raw").glob("synthetic-*.tsv"))
    lines = raw.read_bytes().splitlines(keepends=True)
    codes = assign_splits(np.arange(len(lines), dtype=np.int64), len(lines), SplitConfig(**split))
    rows = check.work / "test_split.tsv"
    rows.write_bytes(b"".join(line for line, c in zip(lines, codes) if c == SPLIT_CODES["test"]))
    scores = check.work / "scores.csv"
    code, output, _ = check.run("predict", [sys.executable, "-m", "pipeline.commands.predict",
                                            f"checkpoint={run_dir / 'model'}", f"input={rows}", f"output={scores}"],
                                env={"CUDA_VISIBLE_DEVICES": ""})
    if code != 0:
        return {"status": "failed", "error": "predict: " + output[-1500:]}
    import pandas as pd
    scored = pd.read_csv(scores)  # probability, and the label the rows carry
    p, y = scored["probability"].to_numpy(), scored["label"].to_numpy()
    if not np.isfinite(p).all():
        return {"status": "failed", "error": "predict: non-finite scores", "predicted_rows": int(len(p))}
    return {"status": "ok", "predicted_rows": int(len(p)), "predict_auc": round(rank_auc(y, p), 6)}


def rank_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank sum (Mann–Whitney U), ties sharing their average rank: an independent check of the
    trainer's AUC (torchmetrics)."""
    values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    ranks = average_rank[inverse]
    positive = labels > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def cowclip_l2_init_from(check: Check) -> dict:
    """CowClip, the embedding L2 term and ``trainer.init_from`` together (what the last GPU issue fixed)."""
    source = Path(check.results.get("uvm_cache", {}).get("output_dir", "")) / "model"
    if not source.is_dir():
        return {"status": "skipped", "why": "needs the model uvm_cache logs"}
    out = check.train("cowclip_l2_init_from", ["scaling=cowclip", "optim.embedding_l2=1e-5",
                                               f"trainer.init_from={source}", "trainer.precision=32-true"])
    if out["status"] == "ok" and not 0.5 < out["test_auc"] <= 1:
        out.update(status="failed", error=f"test_auc {out['test_auc']}: not above chance")
    return out


def ssd(check: Check) -> dict:
    path = check.work / "ssd"
    return {**check.train("ssd", [f"topology.ssd.path={path}", f"+topology.table_overrides.{LARGEST_TABLE}.tier=ssd",
                                  "trainer.precision=32-true"]),
            "path": str(path)}


def fp16_rows(check: Check) -> dict:
    """``train`` with ``model.table_precision=fp16``: its AUC against ``train``'s (both report their planned table MiB)."""
    entry = check.train("fp16_rows", ["trainer.precision=32-true", "model.table_precision=fp16"])
    if entry["status"] == "ok" and check.results.get("train", {}).get("status") == "ok":
        within(entry, "auc_minus_fp32_rows", entry["test_auc"], check.results["train"]["test_auc"], AUC_VS_CPU)
    return entry
