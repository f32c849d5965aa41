"""A training run, composed: parse → data → model and task → trainer → fit and test → publish.

Returns what ``result.json`` holds. ``ctr train`` (:mod:`pipeline.commands.train`) runs it once per
Hydra job; the daily driver (:mod:`pipeline.training.daily`) once per day.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from modules.embedding.ssd_tier.path_lock import release_rank_folders
from modules.sharding.topology import TopologySpec
from pipeline.checkpoint.discovery import complete_checkpoints
from pipeline.checkpoint.resume import resume_checkpoint
from pipeline.config import RunConfig, check_runnable, parse_config
from pipeline.data.datamodule import CTRDataModule
from pipeline.runtime import heap
from pipeline.runtime.hydra_job import output_dir as job_output_dir
from pipeline.runtime.hydra_job import threads_per_job
from pipeline.runtime.launch import global_rank, world_from_env
from pipeline.runtime.library_noise import one_copy_of_each_line
from pipeline.runtime.numa import bind_to_gpu_numa_node
from pipeline.runtime.peers import collective_failure, is_lost_peer
from pipeline.runtime.signals import Preempted, SignalGuard
from pipeline.tracking.store import logging_run, start_logger
from pipeline.tracking.sweeps import sweep_job_tags
from pipeline.training.link_choice import check_link_settings
from pipeline.training.init_from import check_optimizer_source, init_source, lineage_tags
from pipeline.training.precision import resolve_precision
from pipeline.training.publish import publish, register_model, run_result
from pipeline.training.result import RunResult
from pipeline.training.task import CTRTask
from pipeline.training.trainer import build_callbacks, build_trainer


def train(cfg: DictConfig, output_dir: Path | None = None) -> RunResult:
    """Train and test as ``cfg`` says, in ``output_dir`` (default: the Hydra job's folder)."""
    run_cfg = parse_config(cfg)
    check_runnable(run_cfg)
    check_link_settings(run_cfg)
    topology = prepare_process(run_cfg)
    precision, why = resolve_precision(run_cfg.trainer.precision, topology.compute_device)
    if global_rank() == 0:
        print(f"Training in {precision} ({why})", flush=True)
    run_cfg = replace(run_cfg, trainer=replace(run_cfg.trainer, precision=precision))
    output_dir = output_dir or job_output_dir()
    params = save_resolved_config(cfg, output_dir)
    t = run_cfg.trainer
    ckpt_path, run_id = resume_checkpoint(t.resume, t.checkpoint.dir)
    check_optimizer_source(t.init_from, t.init_from_optimizer)
    source = init_source(t.init_from) if ckpt_path is None else None  # checked once; a resumed run has its weights
    logger = start_logger(run_cfg.logger, output_dir, run_id, {**sweep_job_tags(), **lineage_tags(source)})
    if logger:
        logger.log_hyperparams({"trainer/precision_resolved": precision})
    datamodule = CTRDataModule(run_cfg.data, run_cfg.paths.cache_dir, t.batch_size, t.eval_batch_size, run_cfg.seed,
                               run_cfg.model.zch, shuffle=t.shuffle)
    task = CTRTask(run_cfg, topology, resume_from=ckpt_path, init_from=source)
    guard = SignalGuard(t.preemption)
    callbacks = build_callbacks(run_cfg, topology, guard, [hydra.utils.instantiate(c) for c in cfg.trainer.callbacks])
    trainer = build_trainer(run_cfg, topology, callbacks, logger, output_dir)
    bundle = None
    try:
        with guard, logging_run(logger, run_cfg.logger, output_dir) as undelivered:
            trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
            if guard.signum is None:  # a signal during test or publishing is acted on when that work ends
                test = trainer.test(task, datamodule=datamodule, verbose=False)[0]
                bundle = publish(run_cfg, params, task, trainer, datamodule, output_dir, logger)
            if guard.signum is not None:
                raise Preempted(guard, trainer.global_step, t.checkpoint.dir)
    except Exception as e:
        if not is_lost_peer(e):
            raise
        found = complete_checkpoints(t.checkpoint.dir) if t.checkpoint.dir else []
        raise collective_failure(e, trainer.strategy.peers, t.collective_timeout_s, found[-1] if found else None) from e
    finally:
        release_rank_folders()  # the ssd tier's files: every row is in the checkpoints and the model by now
    register_model(run_cfg, logger, bundle, undelivered)
    return run_result(trainer, test, logger, output_dir)


def prepare_process(run_cfg: RunConfig) -> TopologySpec:
    """This process's share of the topology: its NUMA node (CUDA), thread count, heap settings and seeds."""
    world, local_world = world_from_env()
    topology = run_cfg.topology.for_world(world, local_world)
    if topology.compute_device == "cuda":
        bind_to_gpu_numa_node(int(os.environ.get("LOCAL_RANK", 0)), topology.numa)
    threads = run_cfg.trainer.num_threads or threads_per_job()
    if threads:
        torch.set_num_threads(threads)
    heap.keep_training_blocks()  # a step's large blocks reused, not re-faulted (pipeline/runtime/heap.py)
    one_copy_of_each_line()  # Lightning's lines through the run's handlers only
    L.seed_everything(run_cfg.seed, workers=True, verbose=False)
    # the batch moves itself to the device (pipeline.data.batches): Lightning's note on that is no news
    warnings.filterwarnings("ignore", message=".*overridden `transfer_batch_to_device`.*")
    return topology


def save_resolved_config(cfg: DictConfig, output_dir: Path) -> dict:
    """``<output>/resolved_config.yaml``; returns the resolved config as plain containers (the run's
    MLflow parameters)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    params = OmegaConf.to_container(cfg, resolve=True)
    OmegaConf.save(OmegaConf.create(params), output_dir / "resolved_config.yaml")
    return params
