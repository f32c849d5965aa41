"""Train and test a CTR model: ``ctr train [group=option] [key=value] ...`` (or ``python -m pipeline.commands.train``).

Composes ``conf/`` with Hydra, parses it into typed configs (:mod:`pipeline.config`), prepares the
data (cached), trains with Lightning on TorchRec sharded embeddings (1 process, or as many as
``torchrun`` starts), evaluates on the test split, logs everything to MLflow, writes ``result.json``
into the run's output folder (:mod:`pipeline.training.result`) and ends with one line::

    RESULT test_auc=<float> test_logloss=<float> samples_per_s=<float> comm_bytes_per_step=<float> mlflow_run_id=<id>
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from modules.placement import TopologySpec
from pipeline.training.best_validation import BestValidation
from pipeline.training.callbacks import (CommAccounting, CowClipLogging, KStepMerging, ShardedCheckpoint, TrainThroughput,
                                find_callback)
from pipeline.checkpoint.checkpointing import (DCPCheckpointIO, TrainingState, checked_checkpoint, newest_intact_checkpoint,
                                    read_rank0_state)
from pipeline.commands.args import exit_on_user_error
from pipeline.config import LoggerConfig, RunConfig, TrainerConfig, check_runnable, parse_config
from pipeline.data.datamodule import CTRDataModule
from pipeline.data.sources import example_rows
from pipeline.runtime.errors import TrackingUnavailableError
from pipeline.training.init_from import check_optimizer_source, lineage_tags
from pipeline.runtime.launch import global_rank, world_from_env
from pipeline.tracking.pyfunc import log_pyfunc, register
from pipeline.serving.model_folder import unsharded_state, write_bundle
from pipeline.runtime.numa import bind_to_gpu_numa_node
from pipeline.commands.plan import format_plan
from pipeline.training.preemption import Preempted, SignalGuard, StopOnSignal
from pipeline.runtime.process_exit import exit_now, leave_process_group, stop_worker_pools
from pipeline.training.result import RunResult
from pipeline.training.strategy import TorchRecStrategy
from pipeline.tracking.sweeps import parent_tags, record_failure
from pipeline.training.task import CTRTask
from pipeline.tracking.logger import (ORIGINAL_RUN_TAG, ORIGINAL_URI_TAG, TrackedMLflowLogger, bound_http_requests,
                               create_local_store, probe)

log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", message=".*overridden `transfer_batch_to_device`.*")


def _hydra() -> DictConfig | None:
    """Hydra's own config of this job (None when not under @hydra.main: tests compose configs themselves)."""
    return HydraConfig.get() if HydraConfig.initialized() else None


def _in_sweep() -> bool:
    hydra_cfg = _hydra()
    return hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN


def _output_dir() -> Path:
    hydra_cfg = _hydra()
    return Path(hydra_cfg.runtime.output_dir) if hydra_cfg else Path(tempfile.mkdtemp(prefix="ctr-run-"))


def sweep_job_tags() -> dict[str, str]:
    """In a multirun: the parent run's tag, the job's overrides and a run name saying which job it is."""
    if not _in_sweep():
        return {}
    hydra_cfg = _hydra()
    return {**parent_tags(), "ctr.overrides": " ".join(hydra_cfg.overrides.task),
            "mlflow.runName": f"job {hydra_cfg.job.num}"}


def threads_per_job() -> int | None:
    """Under the joblib launcher, each of its ``n_jobs`` parallel jobs gets an equal share of the cores."""
    hydra_cfg = _hydra()
    if hydra_cfg is None or "joblib" not in str(hydra_cfg.launcher.get("_target_", "")):
        return None
    cores = os.cpu_count() or 1
    jobs = int(hydra_cfg.launcher.n_jobs)
    return max(1, cores // (jobs if jobs > 0 else cores))


def tracking_uri(cfg: LoggerConfig, output_dir: Path) -> tuple[str, dict[str, str]]:
    """The store to log to, and tags for the run: ``logger.tracking_uri`` if it answers within
    ``logger.connect_timeout_s``; else, with ``logger.on_unavailable=local``, a store in ``output_dir``."""
    bound_http_requests()
    problem = probe(cfg.tracking_uri, cfg.connect_timeout_s)
    if problem is None:
        create_local_store(cfg.tracking_uri)
        return cfg.tracking_uri, {}
    if cfg.on_unavailable == "fail":
        raise TrackingUnavailableError(f"logger.tracking_uri={cfg.tracking_uri}: no MLflow tracking server answered: "
                                       f"{problem}")
    local = f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
    print(f"MLflow: no tracking server at {cfg.tracking_uri} ({problem}); logging to {local} instead "
          f"(logger.on_unavailable=local). Replay later: ctr sync source={local} "
          f"target={cfg.tracking_uri}", flush=True)
    return local, {ORIGINAL_RUN_TAG: "-", ORIGINAL_URI_TAG: cfg.tracking_uri}


def make_logger(cfg: LoggerConfig, run_id: str | None = None, uri: str | None = None,
                tags: dict[str, str] | None = None) -> TrackedMLflowLogger:
    """The MLflow logger (not started); ``run_id`` (from a resumed checkpoint) is continued if the store has it."""
    uri = uri or cfg.tracking_uri
    if run_id is not None:
        try:
            MlflowClient(uri).get_run(run_id)
        except MlflowException:
            log.warning("The checkpoint's MLflow run %s is not in %s (logger.tracking_uri); logging to a new run",
                        run_id, uri)
            run_id = None
    return TrackedMLflowLogger(experiment_name=cfg.experiment_name, run_name=cfg.run_name, tracking_uri=uri,
                               log_model=False, run_id=run_id, tags=tags or None, retry_max_s=cfg.retry_max_s)


def resume_checkpoint(cfg: TrainerConfig) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, its MLflow run id) for ``trainer.resume`` = null | auto | <path>."""
    if not cfg.resume:
        return None, None
    if cfg.resume == "auto":
        path = newest_intact_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        if path is None:
            return None, None
    else:
        path = checked_checkpoint(cfg.resume)
    state = read_rank0_state(path)
    return str(path), (state.get("pipeline") or {}).get("mlflow_run_id")


def build_callbacks(cfg: RunConfig, topology: TopologySpec, guard: SignalGuard,
                    extra: list[L.Callback]) -> list[L.Callback]:
    """The run's callbacks, in the order they must run after each training step: merge the replicas,
    count the step's bytes, checkpoint, stop on a preemption signal; then the user's ``trainer.callbacks``."""
    t = cfg.trainer
    callbacks: list[L.Callback] = []
    if t.merging.enabled:
        callbacks.append(KStepMerging(t.merging, ranks_per_node=topology.ranks_per_node or 1))
    callbacks += [CommAccounting(), TrainThroughput(), CowClipLogging(), TrainingState(),
                  BestValidation("val/auc", t.plateau_lr_factor, t.plateau_patience, t.early_stopping_patience,
                                 restore_best=t.early_stopping_patience is not None)]
    checkpoint = ShardedCheckpoint(t.checkpoint.dir, t.checkpoint.every_n_steps, t.checkpoint.keep) \
        if t.checkpoint.dir else None
    callbacks += [checkpoint] if checkpoint else []
    callbacks.append(StopOnSignal(guard, checkpoint.save if checkpoint else None))
    return callbacks + extra


def build_trainer(cfg: RunConfig, topology: TopologySpec, callbacks: list[L.Callback], logger: TrackedMLflowLogger | bool,
                  output_dir: Path) -> L.Trainer:
    world = topology.world_size
    cuda = topology.compute_device == "cuda"
    t = cfg.trainer
    return L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=topology.ranks_per_node, num_nodes=world // topology.ranks_per_node,
        strategy=TorchRecStrategy(process_group_backend="nccl" if cuda else "gloo"),
        max_epochs=t.max_epochs, max_steps=t.max_steps, precision=t.precision, logger=logger, callbacks=callbacks,
        enable_checkpointing=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        log_every_n_steps=t.log_every_n_steps, val_check_interval=t.val_check_interval,
        enable_progress_bar=t.enable_progress_bar, enable_model_summary=False, default_root_dir=str(output_dir),
        plugins=[DCPCheckpointIO(find_callback(callbacks, TrainingState), int(t.checkpoint.chunk_mb * 2**20))])


def log_summary(logger: TrackedMLflowLogger, params: dict[str, Any], task: CTRTask, trainer: L.Trainer,
                datamodule: CTRDataModule, output_dir: Path) -> None:
    """Parameters, end-of-run metrics and artifacts (resolved config, sharding plan) of a finished run."""
    try:
        logger.log_hyperparams(params)
    except MlflowException as e:  # a resumed run with changed settings: parameters are immutable
        log.warning("MLflow kept the run's first parameters: %s", e)
    logger.log_hyperparams({**task.scaled_hyperparameters(), "cowclip/global_tables": len(task.cowclip.global_lookups),
                            "cowclip/local_tables": len(task.cowclip.local_lookups)})
    meta = datamodule.store.meta
    throughput, comm, best = (find_callback(trainer.callbacks, cls) for cls in (TrainThroughput, CommAccounting,
                                                                                 BestValidation))
    metrics = {"train/samples_per_s_run": throughput.samples_per_s, "world_size": trainer.world_size,
               **comm.bytes_per_step(), "train/epochs": trainer.current_epoch,
               **{f"data/{k}_rows": v for k, v in meta["splits"].items()},
               **{f"data/skipped_rows/{k}": v for k, v in meta.get("skipped_rows", {}).items()}}
    if "oracle_auc" in meta.get("provenance", {}):
        metrics["data/oracle_auc"] = meta["provenance"]["oracle_auc"]
    if best.best_epoch is not None:
        metrics.update({"val/best_epoch": best.best_epoch, "val/best_auc": best.best})
    logger.log_metrics(metrics)
    plan_file = output_dir / "sharding_plan.txt"
    plan_file.write_text(format_plan(task.plan, task.embedding_optim.name, trainer.world_size) + "\n" + str(task.plan.plan))
    for artifact in (output_dir / "resolved_config.yaml", plan_file):
        logger.experiment.log_artifact(logger.run_id, str(artifact))


def write_model(run_cfg: RunConfig, task: CTRTask, datamodule: CTRDataModule, output_dir: Path,
                run_id: str | None) -> Path | None:
    """``<output>/model`` (:mod:`pipeline.serving.model_folder`) from the trained weights, on global rank 0 (every
    rank takes part in gathering the sharded tables); None where tables exceed ``logger.model_max_gb``."""
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
        weights = unsharded_state(task.model, scratch)
        if weights is None:
            return None
        store = datamodule.store
        return write_bundle(output_dir / "model", weights, task.model_cfg, run_cfg.data, store.meta,
                            store.root / "vocab", run_id)
    finally:
        if global_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def run(cfg: DictConfig, output_dir: Path | None = None) -> RunResult:
    """Train + test as configured; returns what ``result.json`` holds (written by global rank 0)."""
    run_cfg = parse_config(cfg)
    check_runnable(run_cfg)
    world, local_world = world_from_env()
    topology = run_cfg.topology.for_world(world, local_world)
    if topology.compute_device == "cuda":
        bind_to_gpu_numa_node(int(os.environ.get("LOCAL_RANK", 0)), topology.numa)
    threads = run_cfg.trainer.num_threads or threads_per_job()
    if threads:
        torch.set_num_threads(threads)
    L.seed_everything(run_cfg.seed, workers=True, verbose=False)
    output_dir = output_dir or _output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    params = OmegaConf.to_container(cfg, resolve=True)
    OmegaConf.save(OmegaConf.create(params), output_dir / "resolved_config.yaml")

    t = run_cfg.trainer
    ckpt_path, run_id = resume_checkpoint(t)
    check_optimizer_source(t.init_from, t.init_from_optimizer)
    # Only global rank 0 logs; creating the client elsewhere would race on the store's creation.
    logger: TrackedMLflowLogger | bool = False
    if global_rank() == 0:
        uri, tags = tracking_uri(run_cfg.logger, output_dir)
        logger = make_logger(run_cfg.logger, run_id, uri, {**tags, **sweep_job_tags(), **lineage_tags(t.init_from)})
        logger.start()
    datamodule = CTRDataModule(run_cfg.data, run_cfg.paths.cache_dir, t.batch_size, t.eval_batch_size, run_cfg.seed)
    task = CTRTask(run_cfg, topology)
    guard = SignalGuard(t.preemption)
    callbacks = build_callbacks(run_cfg, topology, guard, [hydra.utils.instantiate(c) for c in cfg.trainer.callbacks])
    trainer = build_trainer(run_cfg, topology, callbacks, logger, output_dir)
    bundle: Path | None = None
    undelivered: list[str] = []
    with guard:
        try:
            trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
            if guard.signum is None:
                test = trainer.test(task, datamodule=datamodule, verbose=False)[0]
                bundle = write_model(run_cfg, task, datamodule, output_dir, logger.run_id if logger else None) \
                    if run_cfg.logger.log_model else None
                if logger:
                    log_summary(logger, params, task, trainer, datamodule, output_dir)
                    if bundle is not None:
                        log_pyfunc(logger.experiment, logger.run_id, bundle,
                                   example_rows(run_cfg.data, run_cfg.paths.cache_dir), output_dir / "mlflow_model")
            if guard.signum is not None:
                raise Preempted(guard, trainer.global_step, t.checkpoint.dir)
        except Preempted:
            if logger:
                logger.finalize("killed")
            raise
        except BaseException:
            if logger:
                logger.finalize("failed")
            raise
        finally:
            if logger:
                undelivered = logger.close(run_cfg.logger.flush_timeout_s, output_dir)
                for line in undelivered:
                    print(line, flush=True)
    if logger and run_cfg.logger.register_model_as and bundle is not None and not undelivered:
        version = register(uri, logger.run_id, run_cfg.logger.register_model_as)
        print(f"Registered the model as {run_cfg.logger.register_model_as!r} version {version}", flush=True)

    throughput, comm, best = (find_callback(callbacks, cls) for cls in (TrainThroughput, CommAccounting,
                                                                        BestValidation))
    result = RunResult(test["test/auc"], test["test/logloss"], throughput.samples_per_s,
                       comm.bytes_per_step()["comm/total_bytes_per_step"], logger.run_id if logger else None,
                       str(output_dir), best.best)
    if global_rank() == 0:
        result.write()
    return result


def run_sweep_job(cfg: DictConfig) -> RunResult | None:
    """One job of a multirun: a failure is recorded (job log, sweep parent run) instead of ending the sweep."""
    try:
        return run(cfg)
    except Exception as e:  # noqa: BLE001 - any failure of this job; the others go on
        log.error("Job failed: %s\n%s", e, traceback.format_exc())
        record_failure(cfg, f"{type(e).__name__}: {' '.join(str(e).split())}")
        return None


@hydra.main(version_base="1.3", config_path="pkg://ctr_conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the best validation AUC (what a sweeper maximises); NaN for a failed sweep job."""
    if cfg.trainer.daily:
        from pipeline.training.daily import run_daily

        days = exit_on_user_error(lambda: run_daily(cfg, _output_dir()))
        print(f"Trained {len(days)} days; next-day AUC: "
              f"{', '.join(f'{d.next_day_auc:.4f}' for d in days if d.next_day_auc is not None)} "
              f"(next_day_auc.png, next_day_auc.md in {_output_dir()})", flush=True)
        return days[-1].result.best_val_auc or math.nan
    try:
        result = run_sweep_job(cfg) if _in_sweep() else exit_on_user_error(lambda: run(cfg))
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
    status = 0
    try:
        main()
    except Preempted as stopped:
        status = stopped.code
        if global_rank() == 0:
            print(f"Exiting with status {status}, {stopped.guard.seconds_since_signal():.1f} s after the signal",
                  file=sys.stderr, flush=True)
    stop_worker_pools()
    exit_now(status)  # no interpreter teardown (see pipeline.runtime.process_exit)


if __name__ == "__main__":
    cli()
