"""Sweeps: a real 2-job joblib sweep (one job failing) as an MLflow parent run with its children, the
SLURM launcher's sbatch parameters from the topology (no SLURM needed), and an Optuna search."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import PYTHON, ROOT, compose_config, subprocess_env

TINY = ["data.synthetic.rows=20000", "model.mlp=[16]", "trainer.batch_size=4096", "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false"]


def _multirun(args: list[str], tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [PYTHON, "-m", "pipeline.commands.train", "-m", *TINY, f"paths.cache_dir={tmp}/cache",
           f"logger.tracking_uri=sqlite:///{tmp}/m.db", f"hydra.sweep.dir={tmp}/sweep", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc


def _family(tmp: Path) -> tuple[MlflowClient, object, list]:
    client = MlflowClient(f"sqlite:///{tmp}/m.db")
    parent_id = (tmp / "sweep" / "mlflow_parent_run_id").read_text().strip()
    parent = client.get_run(parent_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return client, parent, children


def test_joblib_sweep_runs_jobs_in_parallel_as_children_of_one_parent_and_survives_a_failing_job(tmp_path):
    _multirun(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model.embedding_dim=8,10"], tmp_path)
    client, parent, children = _family(tmp_path)
    assert parent.info.status == "FINISHED" and parent.data.params["sweep/launcher"].endswith("JoblibLauncher")
    # job 0 (dim 8) trained; job 1 (dim 10, not a multiple of 4) failed, and the sweep says why
    assert [(c.data.tags["ctr.overrides"].split()[-1], c.info.status) for c in children] == \
        [("model.embedding_dim=8", "FINISHED")]
    assert "model.embedding_dim=10" in parent.data.tags["failed.1"] and \
        "ConfigError: model.embedding_dim=10: must be a positive multiple of 4" in parent.data.tags["failed.1"]
    assert parent.data.metrics["sweep/jobs"] == 1 and parent.data.metrics["sweep/failed_jobs"] == 1
    assert parent.data.tags["sweep/best_run"] == children[0].info.run_id
    summary = (tmp_path / "sweep" / "sweep_summary.md").read_text()
    assert children[0].info.run_id[:8] in summary and "Failed jobs" in summary
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"sweep_summary.md"}
    assert (tmp_path / "sweep" / "0" / "result.json").is_file()


def test_slurm_launcher_takes_nodes_tasks_and_gpus_from_the_topology(tmp_path, monkeypatch):
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import _make_sbatch_string

    from pipeline.runtime.launch import world_from_env

    cfg = compose_config(["hydra/launcher=slurm", "topology=2x8gpu", "hydra.launcher.partition=gpu"],
                         return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 8, 8)
    # the plugin's own mapping onto submitit's SLURM parameters, then the sbatch script it would submit
    # no SLURM here: submitit only checks that `srun` exists before it builds anything
    monkeypatch.setattr(submitit.slurm.slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    executor = submitit.AutoExecutor(cluster="slurm", folder=str(tmp_path))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in launcher.items()
                                  if k not in ("_target_", "submitit_folder", "max_num_timeout")})
    sbatch = _make_sbatch_string("python -m pipeline.commands.train", tmp_path, **executor._executor.parameters)
    for flag in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=240"):
        assert flag in sbatch, sbatch
    cpu = OmegaConf.to_container(compose_config(["hydra/launcher=slurm", "topology=cpu"],
                                                return_hydra_config=True).hydra.launcher, resolve=True)
    assert (cpu["nodes"], cpu["tasks_per_node"], cpu["gpus_per_node"]) == (1, 1, None)
    # inside such a job, the world comes from SLURM's variables
    import os

    saved = dict(os.environ)
    try:
        for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)
        os.environ.update(SLURM_NTASKS="16", SLURM_NTASKS_PER_NODE="8")
        assert world_from_env() == (16, 8)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow  # the parent/child runs and failure records: the joblib sweep test; this adds Optuna's search
def test_optuna_sweep_of_six_trials_lists_its_children_and_the_best(tmp_path):
    proc = _multirun(["+experiment=tune_deepfm", "hydra.sweeper.n_trials=6", "trainer.max_epochs=1"], tmp_path)
    client, parent, children = _family(tmp_path)
    assert len(children) == 6 and all(c.info.status == "FINISHED" for c in children)
    aucs = {c.info.run_id: c.data.metrics["val/best_auc"] for c in children}
    best = max(aucs, key=aucs.get)
    assert parent.data.tags["sweep/best_run"] == best
    assert parent.data.metrics["sweep/best_val_auc"] == pytest.approx(aucs[best])
    assert parent.data.params["space/optim.dense.lr"] == "tag(log, interval(1e-4, 1e-2))"
    # the search really varied the rates, and Optuna's best is the best child
    assert len({c.data.params["optim/dense/lr"] for c in children}) == 6
    results = (tmp_path / "sweep" / "optimization_results.yaml").read_text()
    assert f"best_value: {aucs[best]}"[:20] in results and "Best parameters" in proc.stdout + proc.stderr
