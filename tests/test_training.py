"""End-to-end training through the CLI: 1 process and 2 torchrun agents × 2 processes, runs found in MLflow."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.training.result import RunResult, read_result
from tests.conftest import PYTHON, ROOT, MlflowServer, compose_config, free_port, subprocess_env, train_cli

MIN_AUC = 0.72  # small data (100k rows, 2 epochs, oracle AUC ≈ 0.90); a model that learns nothing gives 0.5


def _train(args: list[str], tracking_uri: str, run_dir: Path) -> RunResult:
    proc, result = train_cli([*args, f"logger.tracking_uri={tracking_uri}"], run_dir, timeout=300)
    assert result is not None and result.output_dir == str(run_dir)
    assert proc.stdout.strip().splitlines()[-1] == result.line()  # the RESULT line says the same, for people
    return result


def _check_run(client: MlflowClient, result: RunResult, epochs: int, model: str = "deepfm") -> None:
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert abs(m["test/auc"] - result.test_auc) < 1e-6
    assert abs(m["test/logloss"] - result.test_logloss) < 1e-6
    assert m["train/samples_per_s"] > 0
    assert len(client.get_metric_history(run.info.run_id, "val/auc")) == epochs
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) > 1
    assert run.data.params["model/name"] == model
    assert run.data.params["trainer/batch_size"] == "1024"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"resolved_config.yaml", "sharding_plan.txt"} <= artifacts


# slow: 37 s; training logging to a real mlflow server runs in CI in
# test_every_other_model_trains_to_the_bar_and_its_export_scores_its_test_auc (the same checks of each run)
@pytest.mark.slow
def test_single_process_training_logs_to_a_real_mlflow_server(small_overrides, tmp_path):
    with MlflowServer(tmp_path) as server:
        result = _train(small_overrides, server.uri, tmp_path / "run")
        assert result.test_auc > MIN_AUC, result
        _check_run(MlflowClient(tracking_uri=server.uri), result, epochs=2)


def test_every_other_model_trains_to_the_bar_and_its_export_scores_its_test_auc(small_overrides, cache_dir, tmp_path):
    """wide_deep, dcn and dcnv2 (DeepFM: the other tests), one sweep job each in one process (Hydra's basic
    launcher: one interpreter start) logging to a real ``mlflow server``: each learns (test AUC over the bar),
    its MLflow run holds what it reported, and its checkpoint exported (``ctr export``'s function) and scored
    in this process gives the test split the run's own test AUC."""
    from torchmetrics.functional.classification import binary_auroc

    from pipeline.config import parse_config
    from pipeline.data.sources import store_dir
    from pipeline.data.store import ColumnarStore
    from pipeline.model_folder.export import export_model
    from pipeline.scoring.scorer import Scorer

    models = ["wide_deep", "dcn", "dcnv2"]
    with MlflowServer(tmp_path / "srv") as server:
        cmd = [PYTHON, "-m", "pipeline.commands.train", "-m", *small_overrides, f"model={','.join(models)}",
               "model.mlp=[64,32]", "trainer.max_epochs=1", "trainer.checkpoint.dir=${hydra:runtime.output_dir}/ckpt",
               f"logger.tracking_uri={server.uri}", f"hydra.sweep.dir={tmp_path}/sweep"]
        proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
        for job, model in enumerate(models):
            _check_run(MlflowClient(tracking_uri=server.uri), read_result(tmp_path / "sweep" / str(job)), 1, model)
    test = ColumnarStore(store_dir(parse_config(compose_config(small_overrides)).data, cache_dir)).split("test")
    labels = torch.from_numpy(np.asarray(test.label).astype(np.int64))
    for job, model in enumerate(models):
        result = read_result(tmp_path / "sweep" / str(job))
        assert result.test_auc > MIN_AUC, (model, result)
        scorer = Scorer(export_model(tmp_path / "sweep" / str(job) / "ckpt", tmp_path / f"model{job}"))
        assert scorer.model_cfg.name == model
        auc = float(binary_auroc(torch.from_numpy(scorer.score(test)), labels))
        assert auc == pytest.approx(result.test_auc, abs=1e-6), model


# slow: 19 s; hierarchical merging over 2 × 2 ranks: tests/test_kstep_merging.py::test_hierarchical_merging_two_nodes_of_two
@pytest.mark.slow
def test_two_nodes_of_two_processes_with_hierarchical_merging(small_overrides, tmp_path):
    """Two torchrun agents on 127.0.0.1 stand in for two nodes (c10d rendezvous)."""
    port = free_port()
    def cmd(node: int) -> list[str]:
        return [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes", "-m", "pipeline.commands.train", *small_overrides,
                "trainer.max_epochs=1", "trainer.merging.k=4", "trainer.merging.k_intra=2",
                f"logger.tracking_uri=sqlite:///{tmp_path}/m.db", f"hydra.run.dir={tmp_path}/node{node}"]

    agents = [subprocess.Popen(cmd(node), cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for node in range(2)]
    outputs = [a.communicate(timeout=600) for a in agents]
    for a, (out, err) in zip(agents, outputs):
        assert a.returncode == 0, out[-2000:] + err[-4000:]
    written = [read_result(tmp_path / f"node{n}") for n in range(2) if (tmp_path / f"node{n}" / "result.json").exists()]
    assert len(written) == 1  # written by global rank 0 only
    result = written[0]
    assert sum(out.count("\nRESULT ") + out.startswith("RESULT ") for out, _ in outputs) == 1
    assert result.test_auc > MIN_AUC
    assert result.comm_bytes_per_step > 0  # communication was counted
    _check_run(MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db"), result, epochs=1)


def test_resumed_run_id_missing_from_the_store_starts_a_new_run(tmp_path):
    from pipeline.config import LoggerConfig
    from pipeline.tracking.store import make_logger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = LoggerConfig(tracking_uri=uri, experiment_name="resume")
    first = make_logger(cfg)
    kept = make_logger(cfg, first.run_id)  # a checkpoint's run id that this store has: continued
    assert kept.run_id == first.run_id
    fresh = make_logger(cfg, "0123456789abcdef0123456789abcdef")  # one from another store
    assert fresh.run_id != "0123456789abcdef0123456789abcdef"
    assert MlflowClient(uri).get_run(fresh.run_id).info.experiment_id == first.experiment_id


def test_reference_regime_l2_on_every_row_logs_clipping_per_frequency_bucket(small_overrides, tmp_path):
    """optim=reference (data-parallel Adam tables on CPU) with CowClip and L2 on every row: trains, and the
    clipping statistics count ids in every epoch (they stopped after the first validation while Lightning left
    TorchRec's kernels in eval mode), per frequency bucket, with the plot in the run."""
    uri = f"sqlite:///{tmp_path}/m.db"
    result = _train([*small_overrides, "optim=reference", "scaling=cowclip", "optim.embedding_l2_scope=all",
                     "trainer.log_every_n_steps=10"], uri, tmp_path / "run")
    assert result.test_auc > 0.55, result
    client = MlflowClient(uri)
    run = client.get_run(result.mlflow_run_id)
    assert len(client.get_metric_history(run.info.run_id, "train/cowclip_clipped_fraction")) == 2
    steps_per_epoch = run.data.metrics["data/train_rows"] // 1024
    buckets = [k for k in run.data.metrics if k.startswith("train/cowclip_clipped_fraction/")]
    assert buckets, sorted(run.data.metrics)
    last = max(m.step for k in buckets for m in client.get_metric_history(run.info.run_id, k))
    assert last > steps_per_epoch + 10, (last, steps_per_epoch)
    assert "cowclip_clipped_by_frequency.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
