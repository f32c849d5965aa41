"""The batch-scaling report reads real MLflow runs and writes the table and plot."""

from __future__ import annotations

import subprocess

import mlflow
from mlflow.tracking import MlflowClient

from tests.conftest import PYTHON, ROOT, subprocess_env

RUNS = [  # batch, rule, clip, scale, test AUC[, seed, L2 scope]
    (1024, "none", False, 1.0, 0.8100),
    (4096, "none", False, 4.0, 0.8050),
    (4096, "sqrt", False, 4.0, 0.8070),
    (4096, "cowclip", True, 4.0, 0.8095),
    (4096, "none", True, 4.0, 0.8000),  # an ablation: clipping with the `none` rule
    (4096, "cowclip", True, 4.0, 0.8110, "1", "all"),  # L2 on every row, two seeds: one cell, their mean
    (4096, "cowclip", True, 4.0, 0.8080, "2", "all"),
]


def _log_runs(uri: str) -> None:
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("scaling_test")
    for batch, rule, clip, scale, auc, *seed_scope in RUNS:
        with mlflow.start_run():
            mlflow.log_params({"trainer/batch_size": batch, "scaling/rule": rule, "scaling/cowclip/enabled": clip,
                               "scaled/scale": scale})
            if seed_scope:
                mlflow.log_params({"seed": seed_scope[0], "optim/embedding_l2_scope": seed_scope[1]})
            mlflow.log_metrics({"test/auc": auc, "test/logloss": 0.45, "train/epochs": 3, "val/best_epoch": 1})
    with mlflow.start_run():  # an unfinished run is ignored
        mlflow.log_params({"trainer/batch_size": 1024, "scaling/rule": "cowclip", "scaling/cowclip/enabled": True,
                           "scaled/scale": 1.0})
        mlflow.log_metrics({"test/auc": 0.5, "test/logloss": 0.7})
        mlflow.end_run(status="KILLED")


def test_report_table_plot_and_mlflow_artifacts(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    _log_runs(uri)
    out = tmp_path / "report"
    proc = subprocess.run([PYTHON, "-m", "pipeline.commands.report", "experiment_name=scaling_test", f"tracking_uri={uri}",
                           f"out={out}"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "report.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| batch"))
    assert header == "| batch | none | sqrt | linear | cowclip | cowclip·all | none+clip |"
    rows: dict[str, list[str]] = {}
    for line in table.splitlines():  # the first table (AUC); the second repeats the batches with epochs
        if line.startswith(("| 1,024", "| 4,096")):
            rows.setdefault(line.split("|")[1].strip(), [c.strip() for c in line.split("|")[2:-1]])
    base_row, big_row = rows["1,024"], rows["4,096"]
    assert base_row[0] == "0.8100 (+0.0000)"
    assert base_row[1] == base_row[2] == "0.8100 (+0.0000) †"  # sqrt, linear at s = 1: the same run
    assert base_row[3] == "–"  # the killed CowClip run is not reported
    assert big_row[0] == "0.8050 (-0.0050)" and big_row[1] == "0.8070 (-0.0030)" and big_row[2] == "–"
    assert big_row[3] == "0.8095 (-0.0005)" and big_row[5] == "0.8000 (-0.0100)"
    assert big_row[4] == "0.8095 (-0.0005) [mean of 2 seeds, spread 0.0030]"
    assert (out / "auc_vs_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("scaling_test")
    report_runs = client.search_runs([exp.experiment_id], filter_string="tags.report = 'true'")
    assert len(report_runs) == 1
    assert {a.path for a in client.list_artifacts(report_runs[0].info.run_id)} == {"report.md", "auc_vs_batch.png"}
