"""Preemption and concurrency (pipeline/runtime/signals.py): a signal stops a run after the current step with a
checkpoint, the MLflow run KILLED and status 128 + signal, and ``trainer.resume=auto`` then ends exactly as
an uninterrupted run; runs started together share a fresh MLflow store and an empty data cache."""

from __future__ import annotations

import subprocess

import pytest
from filelock import FileLock
from mlflow.tracking import MlflowClient

from pipeline.checkpoint.discovery import complete_checkpoints
from tests.conftest import PYTHON, ROOT, subprocess_env, train_cli


def signal_during(rank: int, step: int) -> str:
    return f"trainer.callbacks=[{{_target_:tests.faults.SignalDuringStep,rank:{rank},step:{step}}}]"


def _runs(uri: str) -> list:
    client = MlflowClient(uri)
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


# slow: 52 s; SIGTERM mid-epoch → checkpoint, exit 143, MLflow run KILLED, exact resume of the same run runs in CI
# with two ranks: tests/test_checkpointing.py::test_sigterm_to_one_of_two_ranks_stops_both_after_the_same_step_and_resumes_exactly
@pytest.mark.slow
def test_sigterm_mid_epoch_checkpoints_exits_143_and_resumes_exactly(small_overrides, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ckpt = tmp_path / "ckpt"
    args = [*small_overrides, f"logger.tracking_uri={uri}", f"trainer.checkpoint.dir={ckpt}"]
    _, straight = train_cli([*small_overrides, f"logger.tracking_uri={uri}"], tmp_path / "straight")
    # 83 steps per epoch: the signal arrives during step 120, in the second epoch
    stopped, result = train_cli([*args, signal_during(0, 120)], tmp_path / "stopped", check=False)
    assert stopped.returncode == 128 + 15 and result is None, stopped.stderr[-3000:]
    assert "Stopped by SIGTERM after step 120" in stopped.stderr and "MLflow run marked KILLED" in stopped.stderr
    assert complete_checkpoints(ckpt)[-1].name == "step-000000120"
    killed = [r for r in _runs(uri) if r.info.status == "KILLED"]
    assert len(killed) == 1
    _, resumed = train_cli([*args, "trainer.resume=auto"], tmp_path / "resumed")
    assert (resumed.test_auc, resumed.test_logloss) == (straight.test_auc, straight.test_logloss)
    assert resumed.mlflow_run_id == killed[0].info.run_id  # the same MLflow run continued


def test_runs_started_together_on_a_fresh_store_and_an_empty_cache_both_finish(tmp_path):
    args = [f"paths.cache_dir={tmp_path}/cache", "data.synthetic.rows=30000", "trainer.batch_size=1024",
            "trainer.max_epochs=1", "model.mlp=[16]", "trainer.enable_progress_bar=false", "logger.log_model=false",
            f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    procs = [subprocess.Popen([PYTHON, "-m", "pipeline.commands.train", *args, f"hydra.run.dir={tmp_path}/run{i}"], cwd=ROOT,
                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert sorted(r.info.status for r in _runs(f"sqlite:///{tmp_path}/mlflow.db")) == ["FINISHED", "FINISHED"]
    stores = [p for p in (tmp_path / "cache" / "stores").iterdir() if p.is_dir()]
    assert len(stores) == 1 and (stores[0] / "meta.json").is_file()  # built once, reused by the other run


def test_a_checkpoint_folder_in_use_is_refused(small_overrides, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with FileLock(str(ckpt / ".lock")):  # as a running job holds it
        proc, _ = train_cli([*small_overrides, f"trainer.checkpoint.dir={ckpt}", "trainer.max_steps=1",
                             f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"], tmp_path / "run", check=False)
    assert proc.returncode == 2 and f"trainer.checkpoint.dir={ckpt} is in use by another running job" in proc.stderr
