"""``ctr train [group=option] [key=value] ...`` (or ``python -m pipeline.commands.train``): train and test a
CTR model (:func:`pipeline.training.run.train`).

Composes ``conf/`` with Hydra, prepares the data (cached), trains with Lightning on TorchRec sharded
embeddings (1 process, or as many as ``torchrun`` starts), evaluates on the test split, logs everything
to MLflow, writes ``result.json`` into the run's output folder and ends with one line::

    RESULT test_auc=<float> test_logloss=<float> samples_per_s=<float> comm_bytes_per_step=<float> mlflow_run_id=<id>

Under ``--multirun`` each job is one run; a failed job is recorded on the sweep's MLflow parent run
and the sweep goes on.
"""

from __future__ import annotations

import logging
import math
import sys
import traceback

import hydra
from omegaconf import DictConfig

from pipeline.commands.args import exit_on_user_error
from pipeline.config import register_configs
from pipeline.runtime.hydra_job import in_sweep
from pipeline.runtime.launch import global_rank
from pipeline.runtime.process_exit import exit_now, leave_process_group, stop_worker_pools
from pipeline.runtime.signals import Preempted
from pipeline.tracking.sweeps import record_failure
from pipeline.training.result import RunResult
from pipeline.training.run import train
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path

log = logging.getLogger(__name__)


def run_sweep_job(cfg: DictConfig) -> RunResult | None:
    """One job of a multirun: a failure is recorded (job log, sweep parent run) instead of ending the sweep."""
    try:
        return train(cfg)
    except Exception as e:  # noqa: BLE001 - any failure of this job; the others go on
        log.error("Job failed: %s\n%s", e, traceback.format_exc())
        record_failure(cfg, f"{type(e).__name__}: {' '.join(str(e).split())}")
        return None


@hydra.main(version_base="1.3", config_path=config_path(), config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the best validation AUC (what a sweeper maximises); NaN for a failed sweep job."""
    try:
        result = run_sweep_job(cfg) if in_sweep() else exit_on_user_error(lambda: train(cfg))
    finally:
        leave_process_group()
    if result is None:
        return math.nan
    if result.mlflow_run_id is not None:
        print(f"MLflow run {result.mlflow_run_id} in experiment '{cfg.logger.experiment_name}' at "
              f"{cfg.logger.tracking_uri} (browse: mlflow ui --backend-store-uri {cfg.logger.tracking_uri})")
        print(f"Output folder: {result.output_dir} (result.json, resolved_config.yaml, sharding_plan.txt)")
        print(result.line(), flush=True)
    return math.nan if result.best_val_auc is None else result.best_val_auc


def cli() -> None:
    """``ctr train`` / ``python -m pipeline.commands.train``."""
    register_configs()
    check_overrides(config_path(), "config")
    status = 0
    try:
        main()
    except Preempted as stopped:
        status = stopped.code
        if global_rank() == 0:
            print(f"Exiting with status {status}, {stopped.guard.seconds_since_signal():.1f} s after the signal",
                  file=sys.stderr, flush=True)
    except SystemExit as stopped:  # Hydra's exit after an error, or a user error's: also left without teardown,
        status = stopped.code if isinstance(stopped.code, int) else (0 if stopped.code is None else 1)  # which
        if isinstance(stopped.code, str):                                # can wait on a lost peer's sockets
            print(stopped.code, file=sys.stderr, flush=True)
    stop_worker_pools()
    exit_now(status)  # no interpreter teardown (see pipeline.runtime.process_exit)


if __name__ == "__main__":
    cli()
