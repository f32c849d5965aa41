"""What a finished run leaves behind: the model folder (``<output>/model``), its summary and the MLflow
model in the run, the registered model version, and ``result.json`` with the ``RESULT`` line."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L

from modules.embedding.table_precision import table_bytes
from modules.embedding.table_views import sync_tables
from modules.sharding.plan_report import format_plan
from modules.embedding.zch.mapping import mapping_state
from pipeline.config import RunConfig
from pipeline.data.datamodule import CTRDataModule
from pipeline.data.sources import example_rows
from pipeline.runtime.launch import global_rank
from pipeline.model_folder.export import export_model
from pipeline.model_folder.layout import write_bundle
from pipeline.model_folder.weights import unsharded_state
from pipeline.tracking.logger import TrackedMLflowLogger
from pipeline.tracking.pyfunc import log_pyfunc, register
from pipeline.training.best_validation import BestValidation
from pipeline.training.callbacks import find_callback
from pipeline.training.callbacks.comm_accounting import CommAccounting
from pipeline.training.callbacks.throughput import TrainThroughput
from pipeline.training.result import RunResult
from pipeline.training.task import CTRTask



def write_model(run_cfg: RunConfig, task: CTRTask, datamodule: CTRDataModule, output_dir: Path,
                run_id: str | None) -> Path | None:
    """``<output>/model`` (:mod:`pipeline.model_folder.layout`) from the trained weights, on global rank 0
    (every rank takes part in gathering the sharded tables); None where tables exceed ``logger.model_max_gb``."""
    spec = datamodule.feature_spec
    gb = sum(n * (task.model_cfg.embedding_dim + 4) * 4 for n in spec.table_sizes.values()) / 1e9
    if gb > run_cfg.logger.model_max_gb:
        if global_rank() == 0:
            print(f"The tables take {gb:.2g} GB > logger.model_max_gb={run_cfg.logger.model_max_gb:g}: no model folder "
                  f"and no MLflow model; score with ctr predict checkpoint=<this run's trainer.checkpoint.dir> "
                  f"(under torchrun: the tables stay sharded)", flush=True)
        return None
    scratch = output_dir / ".model-tables"  # every rank writes its shards of each table here (table_files)
    try:
        sync_tables(task.model)  # the ssd tier's files hold every row (tables are read from them)
        weights = unsharded_state(task.model, scratch)
        zch_state = mapping_state(task.zch.remapper) if task.zch is not None else None  # every rank sends its units'
        if weights is None:
            return None
        store = datamodule.store
        return write_bundle(output_dir / "model", weights, task.model_cfg, run_cfg.data, datamodule.meta,
                            store.root / "vocab", run_id, zch_state=zch_state)
    finally:
        if global_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def log_summary(logger: TrackedMLflowLogger, params: dict[str, Any], task: CTRTask, trainer: L.Trainer,
                datamodule: CTRDataModule, output_dir: Path) -> None:
    """Parameters, end-of-run metrics and artifacts (resolved config, sharding plan) of a finished run."""
    logger.log_hyperparams(params)  # (a resumed run: changed settings as tags resumed/<key>)
    logger.log_hyperparams({**task.scaled_hyperparameters(), "cowclip/global_tables": len(task.cowclip.global_lookups),
                            "cowclip/local_tables": len(task.cowclip.local_lookups),
                            "model/stacked_tables": task.model_cfg.stack_tables,
                            "model/onednn_mlp_used": task.onednn_mlp_used,
                            "model/overlap_embedding_backward_used": task.overlap_embedding_backward_used,
                            **task.link.params()})
    meta = datamodule.store.meta
    throughput, comm, best = (find_callback(trainer.callbacks, cls) for cls in (TrainThroughput, CommAccounting,
                                                                                 BestValidation))
    metrics = {"train/samples_per_s_run": throughput.samples_per_s, "world_size": trainer.world_size,
               **comm.bytes_per_step(), "train/epochs": trainer.current_epoch,
               **{f"data/{k}_rows": v for k, v in meta["splits"].items()},
               **{f"data/skipped_rows/{k}": v for k, v in meta.get("skipped_rows", {}).items()}}
    tuner = next((m.overlap_tuner for m in task.model.modules() if hasattr(m, "overlap_tuner")), None)
    if tuner is not None and task.overlap_embedding_backward_used:  # (modules/models/backward_overlap.py)
        metrics.update({"train/overlap_beside_at_end": float(tuner.beside), "train/overlap_switches": tuner.switches})
    if throughput.samples_per_s_after_warmup is not None:
        metrics.update({"train/samples_per_s_after_warmup": throughput.samples_per_s_after_warmup,
                        "train/warmup_s": throughput.warmup_s})
    if "oracle_auc" in meta.get("provenance", {}):
        metrics["data/oracle_auc"] = meta["provenance"]["oracle_auc"]
    if best.best_epoch is not None:
        metrics.update({"val/best_epoch": best.best_epoch, "val/best_auc": best.best})
    metrics.update({f"model/{k}": v for k, v in table_bytes(task.plan.placements, task.model_cfg.table_precision).items()})
    logger.log_metrics(metrics)
    plan_file = output_dir / "sharding_plan.txt"
    plan_file.write_text(format_plan(task.plan, task.embedding_optim.name, trainer.world_size) + "\n" + str(task.plan.plan))
    for artifact in (output_dir / "resolved_config.yaml", plan_file):
        logger.experiment.log_artifact(logger.run_id, str(artifact))


def publish(run_cfg: RunConfig, params: dict[str, Any], task: CTRTask, trainer: L.Trainer,
            datamodule: CTRDataModule, output_dir: Path, logger: TrackedMLflowLogger | bool) -> Path | None:
    """The model folder (with ``logger.log_model``), the run's summary and its MLflow model; returns the folder."""
    bundle = write_model(run_cfg, task, datamodule, output_dir, logger.run_id if logger else None) \
        if run_cfg.logger.log_model else None
    if logger:
        log_summary(logger, params, task, trainer, datamodule, output_dir)
        if bundle is not None:
            q = run_cfg.logger.quantize
            served = bundle if q == "none" else export_model(bundle, output_dir / f"model_{q}", q)
            log_pyfunc(logger.experiment, logger.run_id, served, example_rows(run_cfg.data, run_cfg.paths.cache_dir),
                       output_dir / "mlflow_model", run_cfg.logger.model_signature)
    return bundle


def register_model(run_cfg: RunConfig, logger: TrackedMLflowLogger | bool, bundle: Path | None,
                   undelivered: list[str]) -> None:
    """With ``logger.register_model_as``: a new version of that registered model, once the run's logging
    reached the store."""
    name = run_cfg.logger.register_model_as
    if logger and name and bundle is not None and not undelivered:
        version = register(logger.tracking_uri, logger.run_id, name)
        print(f"Registered the model as {name!r} version {version}", flush=True)


def run_result(trainer: L.Trainer, test: dict[str, float], logger: TrackedMLflowLogger | bool,
               output_dir: Path) -> RunResult:
    """The run's result, written to ``result.json`` by global rank 0."""
    throughput, comm, best = (find_callback(trainer.callbacks, cls) for cls in (TrainThroughput, CommAccounting,
                                                                                 BestValidation))
    task = trainer.lightning_module
    result = RunResult(test["test/auc"], test["test/logloss"], throughput.samples_per_s,
                       comm.bytes_per_step()["comm/total_bytes_per_step"], logger.run_id if logger else None,
                       str(output_dir), best.best, throughput.samples_per_s_after_warmup, throughput.warmup_s,
                       **table_bytes(task.plan.placements, task.model_cfg.table_precision))
    if global_rank() == 0:
        result.write()
    return result
