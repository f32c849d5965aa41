"""Train and test a CTR model: ``python -m pipeline.train [group=option] [key=value] ...``.

Composes ``conf/`` with Hydra, prepares the data (cached), trains with Lightning on TorchRec
sharded embeddings (1 process, or as many as ``torchrun`` starts), evaluates on the test split,
logs everything to MLflow and ends with one line::

    RESULT test_auc=<float> test_logloss=<float> samples_per_s=<float> comm_bytes_per_step=<float> mlflow_run_id=<id>
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from lightning.pytorch.callbacks import EarlyStopping

from mlflow.exceptions import MlflowException

from pipeline.callbacks import RestoreBestWeights, ShardedCheckpoint, TrainThroughput
from pipeline.checkpointing import DCPCheckpointIO, complete_checkpoints, read_rank0_state
from pipeline.config_check import ConfigError, check_config, world_from_env
from pipeline.data.datamodule import CTRDataModule
from pipeline.numa import bind_to_gpu_numa_node
from pipeline.plan import format_plan
from pipeline.process_exit import exit_now, leave_process_group
from pipeline.strategy import TorchRecStrategy
from pipeline.task import CTRTask

log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", message=".*overridden `transfer_batch_to_device`.*")


def _output_dir() -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under @hydra.main (tests compose the config themselves)
        return Path(tempfile.mkdtemp(prefix="ctr-run-"))


def make_logger(cfg: DictConfig, run_id: str | None = None) -> MLFlowLogger:
    """The MLflow logger; ``run_id`` (from a resumed checkpoint) is continued if the store has it."""
    if run_id is not None:
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(cfg.logger.tracking_uri).get_run(run_id)
        except MlflowException:
            log.warning("The checkpoint's MLflow run %s is not in %s (logger.tracking_uri); logging to a new run",
                        run_id, cfg.logger.tracking_uri)
            run_id = None
    return MLFlowLogger(experiment_name=cfg.logger.experiment_name, run_name=cfg.logger.run_name,
                        tracking_uri=cfg.logger.tracking_uri, log_model=False, run_id=run_id)


def resume_checkpoint(cfg: DictConfig) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, its MLflow run id) for ``trainer.resume`` = null | auto | <path>."""
    resume = cfg.trainer.get("resume")
    if not resume:
        return None, None
    if resume == "auto":
        folder = cfg.trainer.checkpoint.dir
        found = complete_checkpoints(folder) if folder else []
        if not found:
            return None, None
        path = found[-1]
    else:
        path = Path(resume)
    state = read_rank0_state(path)
    return str(path), (state.get("pipeline") or {}).get("mlflow_run_id")


def run(cfg: DictConfig, output_dir: Path | None = None) -> dict[str, Any]:
    """Train + test as configured; returns the test metrics, throughput and MLflow run id."""
    check_config(cfg)
    world, local_world = world_from_env()
    if cfg.topology.compute_device == "cuda":
        bind_to_gpu_numa_node(int(os.environ.get("LOCAL_RANK", 0)), cfg.topology.get("numa"))
    if cfg.trainer.num_threads:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    output_dir = output_dir or _output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    config_path = output_dir / "resolved_config.yaml"
    OmegaConf.save(OmegaConf.create(resolved), config_path)

    datamodule = CTRDataModule(cfg.data, cfg.paths.cache_dir, cfg.trainer.batch_size,
                               cfg.trainer.eval_batch_size, cfg.seed)
    plain = resolved  # plain Python containers (checkpoints store them as JSON)
    task = CTRTask(plain["model"], plain["optim"], plain["topology"], plain["scaling"], cfg.trainer.batch_size,
                   cfg.trainer.get("plateau_lr_factor"), plain["trainer"].get("merging"),
                   cfg.trainer.get("plateau_patience", 1), cfg.trainer.get("nonfinite", "stop"),
                   plain["trainer"].get("debug"))
    ckpt_path, run_id = resume_checkpoint(cfg)
    # Only global rank 0 logs; creating the client elsewhere would race on the store's creation.
    logger = make_logger(cfg, run_id) if int(os.environ.get("RANK", 0)) == 0 else False
    throughput = TrainThroughput()
    callbacks: list[L.Callback] = [throughput]
    if cfg.trainer.checkpoint.dir:
        callbacks.append(ShardedCheckpoint(cfg.trainer.checkpoint.dir, cfg.trainer.checkpoint.every_n_steps,
                                           cfg.trainer.checkpoint.keep))
    if cfg.trainer.early_stopping_patience is not None:
        callbacks += [EarlyStopping(monitor="val/auc", mode="max", patience=cfg.trainer.early_stopping_patience),
                      RestoreBestWeights(monitor="val/auc", mode="max")]
    cuda = cfg.topology.compute_device == "cuda"
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=local_world,
        num_nodes=world // local_world,
        strategy=TorchRecStrategy(process_group_backend="nccl" if cuda else "gloo"),
        max_epochs=cfg.trainer.max_epochs,
        max_steps=cfg.trainer.get("max_steps", -1),
        precision=cfg.trainer.precision,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        val_check_interval=cfg.trainer.val_check_interval,
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_model_summary=False,
        default_root_dir=str(output_dir),
        plugins=[DCPCheckpointIO(task.checkpoint_tensors)],
    )
    trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
    test = trainer.test(task, datamodule=datamodule, verbose=False)[0]

    comm = task.comm_bytes_per_step()
    result = {"test_auc": test["test/auc"], "test_logloss": test["test/logloss"],
              "samples_per_s": throughput.samples_per_s, "comm_bytes_per_step": comm["comm/total_bytes_per_step"],
              "mlflow_run_id": None}
    if logger:
        try:
            logger.log_hyperparams(resolved)
        except MlflowException as e:  # a resumed run with changed settings: parameters are immutable
            log.warning("MLflow kept the run's first parameters: %s", e)
        meta = datamodule.store.meta
        logger.log_hyperparams({**task.scaled_hyperparameters(),
                                "cowclip/global_tables": len(task.cowclip_tables.get("global", ())),
                                "cowclip/local_tables": len(task.cowclip_tables.get("local", ()))})
        extra = {"train/samples_per_s_run": throughput.samples_per_s, "world_size": world, **comm,
                 "train/epochs": trainer.current_epoch,
                 **{f"data/{k}_rows": v for k, v in meta["splits"].items()}}
        extra.update({f"data/skipped_rows/{k}": v for k, v in meta.get("skipped_rows", {}).items()})
        if "oracle_auc" in meta.get("provenance", {}):
            extra["data/oracle_auc"] = meta["provenance"]["oracle_auc"]
        best = next((c for c in callbacks if isinstance(c, RestoreBestWeights)), None)
        if best is not None and best.best_epoch is not None:
            extra["val/best_epoch"] = best.best_epoch
            extra["val/best_auc"] = best.best
        logger.log_metrics(extra)
        (output_dir / "sharding_plan.txt").write_text(
            format_plan(task.plan, task.embedding_optim.name, world) + "\n" + str(task.plan.plan))
        for artifact in (config_path, output_dir / "sharding_plan.txt"):
            logger.experiment.log_artifact(logger.run_id, str(artifact))
        result["mlflow_run_id"] = logger.run_id
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        result = run(cfg)
    except ConfigError as e:
        sys.exit(f"Config error: {e}")
    finally:
        leave_process_group()
    if result["mlflow_run_id"] is not None:
        print(f"MLflow run {result['mlflow_run_id']} in experiment '{cfg.logger.experiment_name}' at "
              f"{cfg.logger.tracking_uri} (browse: mlflow ui --backend-store-uri {cfg.logger.tracking_uri})")
        print(f"RESULT test_auc={result['test_auc']:.6f} test_logloss={result['test_logloss']:.6f} "
              f"samples_per_s={result['samples_per_s']:.1f} comm_bytes_per_step={result['comm_bytes_per_step']:.0f} "
              f"mlflow_run_id={result['mlflow_run_id']}", flush=True)


if __name__ == "__main__":
    main()
    exit_now(0)  # a finished run: no interpreter teardown (see pipeline.process_exit)
