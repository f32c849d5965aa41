"""A Hydra multirun as one MLflow parent run with each job as a child run (nested in the MLflow UI).

Registered as a Hydra callback (``hydra.callbacks.mlflow_sweep`` in ``conf/config.yaml``):

* ``on_multirun_start`` (the launching process): creates the parent run in ``logger.experiment_name``
  with the sweep's overrides, its search space (``hydra.sweeper.params``) and launcher as parameters,
  and writes its id to ``<hydra.sweep.dir>/mlflow_parent_run_id``, where every job finds it — in this
  process (basic launcher) or in worker processes (joblib, submitit);
* each job's run is created with the tag ``mlflow.parentRunId`` (:func:`sweep_job_tags`);
* a job that fails does not stop the sweep: :func:`pipeline.commands.train.main` records the error on the
  parent as ``failed.<job number>`` = overrides and error (:func:`record_failure`) and returns NaN,
  which the Optuna sweeper counts as a failed trial; ``on_job_end`` records jobs that Hydra itself
  saw fail;
* ``on_multirun_end``: ``sweep_summary.md`` (every child: overrides, best validation AUC, test AUC,
  status; the best first) as an artifact of the parent, its best values as metrics, the parent closed
  (FAILED if no job finished). ``ctr report parent=<id>`` reports on the children.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from pipeline.runtime.hydra_job import hydra_config, in_sweep

log = logging.getLogger(__name__)
PARENT_FILE = "mlflow_parent_run_id"
PARENT_TAG = "mlflow.parentRunId"


def _parent_file(sweep_dir: str) -> Path:
    return Path(sweep_dir) / PARENT_FILE


def parent_run_id() -> str | None:
    """The running sweep's parent run (None outside a sweep, or a sweep without the callback)."""
    hydra_cfg = hydra_config()
    if not in_sweep():
        return None
    path = _parent_file(hydra_cfg.sweep.dir)
    return path.read_text().strip() if path.is_file() else None


def sweep_job_tags() -> dict[str, str]:
    """In a multirun: the parent run's tag, the job's overrides and a run name saying which job it is."""
    if not in_sweep():
        return {}
    hydra_cfg = hydra_config()
    parent = parent_run_id()
    return {**({PARENT_TAG: parent} if parent else {}), "ctr.overrides": " ".join(hydra_cfg.overrides.task),
            "mlflow.runName": f"job {hydra_cfg.job.num}"}


def record_failure(config: DictConfig, why: str) -> None:
    """Write ``failed.<job number>`` = the job's overrides and ``why`` on the sweep's parent run (called in
    the job's process, where Hydra's config says which job it is)."""
    parent = parent_run_id()
    if parent is None:
        return
    job = hydra_config().job
    overrides = " ".join(hydra_config().overrides.task)
    try:
        MlflowClient(config.logger.tracking_uri).set_tag(parent, f"failed.{job.num}", f"{overrides}: {why}"[:5000])
    except MlflowException as e:  # the record is lost, not the sweep
        log.warning("could not record the failure of job %s on the sweep's MLflow run %s: %s", job.num, parent, e)


def _experiment_id(client: MlflowClient, name: str) -> str:
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(name)


def child_rows(client: MlflowClient, parent: str) -> list[dict[str, Any]]:
    """The parent's children: run id, name, swept overrides, metrics, status; best validation AUC first."""
    run = client.get_run(parent)
    children = client.search_runs([run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent}'",
                                  max_results=10000)
    rows = [{"run_id": c.info.run_id, "name": c.info.run_name, "status": c.info.status,
             "overrides": c.data.tags.get("ctr.overrides", ""), "val_auc": c.data.metrics.get("val/best_auc"),
             "test_auc": c.data.metrics.get("test/auc")} for c in children]
    return sorted(rows, key=lambda r: -(r["val_auc"] if r["val_auc"] is not None else -math.inf))


def summary_table(rows: list[dict[str, Any]]) -> str:
    def num(x: float | None) -> str:
        return "–" if x is None else f"{x:.5f}"

    lines = ["| run | overrides | best val AUC | test AUC | status |", "|---|---|---:|---:|---|"]
    lines += [f"| {r['name']} ({r['run_id'][:8]}) | {r['overrides']} | {num(r['val_auc'])} | {num(r['test_auc'])} | "
              f"{r['status']} |" for r in rows]
    return "\n".join(lines) + "\n"


class MlflowSweep(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        client = MlflowClient(config.logger.tracking_uri)
        exp = _experiment_id(client, config.logger.experiment_name)
        sweep_dir = Path(config.hydra.sweep.dir)
        run = client.create_run(exp, run_name=f"sweep {sweep_dir.name}", tags={"ctr.sweep": "parent"})
        params = {"sweep/overrides": " ".join(config.hydra.overrides.task) or "(none)",
                  "sweep/sweeper": config.hydra.sweeper.get("_target_", "?"),
                  "sweep/launcher": config.hydra.launcher.get("_target_", "?"), "sweep/dir": str(sweep_dir)}
        searched = config.hydra.sweeper.get("params")
        space = OmegaConf.to_container(searched, resolve=False) if searched else {}
        params.update({f"space/{k}": str(v) for k, v in space.items()})
        client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in params.items()])
        sweep_dir.mkdir(parents=True, exist_ok=True)
        _parent_file(str(sweep_dir)).write_text(run.info.run_id + "\n")
        print(f"MLflow: sweep parent run {run.info.run_id} in experiment '{config.logger.experiment_name}'", flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            record_failure(config, f"{type(error).__name__}: {error}")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        path = _parent_file(config.hydra.sweep.dir)
        if not path.is_file():
            return
        parent = path.read_text().strip()
        client = MlflowClient(config.logger.tracking_uri)
        rows = child_rows(client, parent)
        out = Path(config.hydra.sweep.dir) / "sweep_summary.md"
        failed = {k: v for k, v in client.get_run(parent).data.tags.items() if k.startswith("failed.")}
        text = summary_table(rows) + ("\nFailed jobs:\n\n" + "\n".join(f"- job {k[7:]}: {v}" for k, v in
                                                                         sorted(failed.items())) + "\n" if failed else "")
        out.write_text(text)
        client.log_artifact(parent, str(out))
        best = next((r for r in rows if r["val_auc"] is not None), None)
        if best is not None:
            client.log_metric(parent, "sweep/best_val_auc", best["val_auc"])
            client.set_tag(parent, "sweep/best_run", best["run_id"])
            client.set_tag(parent, "sweep/best_overrides", best["overrides"])
        client.log_metric(parent, "sweep/jobs", len(rows))
        client.log_metric(parent, "sweep/failed_jobs", len(failed))
        finished = any(r["status"] == "FINISHED" for r in rows)
        client.set_terminated(parent, "FINISHED" if finished else "FAILED")
        print(text, flush=True)
