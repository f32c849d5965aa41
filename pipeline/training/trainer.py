"""The Lightning ``Trainer`` of a run and its callbacks, from the typed config."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L

from modules.sharding.topology import TopologySpec
from pipeline.checkpoint.dcp_io import DCPCheckpointIO
from pipeline.checkpoint.sharded_checkpoint import ShardedCheckpoint
from pipeline.checkpoint.training_state import TrainingState
from pipeline.config import RunConfig
from pipeline.runtime.signals import SignalGuard
from pipeline.tracking.logger import TrackedMLflowLogger
from pipeline.training.best_validation import BestValidation
from pipeline.training.callbacks import find_callback
from pipeline.training.callbacks.comm_accounting import CommAccounting
from pipeline.training.callbacks.cowclip_logging import CowClipLogging
from pipeline.training.callbacks.kstep_merging import KStepMerging
from pipeline.training.callbacks.next_batch_rows import NextBatchRows
from pipeline.training.callbacks.row_cache_logging import RowCacheLogging
from pipeline.training.callbacks.stop_on_signal import StopOnSignal
from pipeline.training.callbacks.throughput import TrainThroughput
from pipeline.training.strategy import TorchRecStrategy


def build_callbacks(cfg: RunConfig, topology: TopologySpec, guard: SignalGuard,
                    extra: list[L.Callback]) -> list[L.Callback]:
    """The run's callbacks, in the order they must run after each training step: merge the replicas,
    count the step's bytes, checkpoint, stop on a preemption signal; then the user's ``trainer.callbacks``."""
    t = cfg.trainer
    # k=auto may resolve to a period once the model is built (pipeline/training/link_choice.py): the callback
    # then reads the resolved one from the task
    merging = KStepMerging(topology.ranks_per_node or 1, timedelta(seconds=t.collective_timeout_s)) \
        if t.merging.k is not None else None
    callbacks: list[L.Callback] = [merging] if merging else []
    callbacks += [CommAccounting(), TrainThroughput(), RowCacheLogging(), CowClipLogging(), TrainingState(), NextBatchRows(),
                  BestValidation("val/auc", t.plateau_lr_factor, t.plateau_patience, t.early_stopping_patience,
                                 restore_best=t.early_stopping_patience is not None)]
    checkpoint = ShardedCheckpoint(t.checkpoint.dir, t.checkpoint.every_n_steps, t.checkpoint.keep) \
        if t.checkpoint.dir else None
    callbacks += [checkpoint] if checkpoint else []
    callbacks.append(StopOnSignal(guard, checkpoint.save if checkpoint else None))
    return callbacks + extra


def build_trainer(cfg: RunConfig, topology: TopologySpec, callbacks: list[L.Callback],
                  logger: TrackedMLflowLogger | bool, output_dir: Path) -> L.Trainer:
    world = topology.world_size
    cuda = topology.compute_device == "cuda"
    t = cfg.trainer
    return L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=topology.ranks_per_node, num_nodes=world // topology.ranks_per_node,
        strategy=TorchRecStrategy(process_group_backend="nccl" if cuda else "gloo",
                                  timeout=timedelta(seconds=t.collective_timeout_s)),
        max_epochs=t.max_epochs, max_steps=t.max_steps, precision=t.precision, logger=logger, callbacks=callbacks,
        enable_checkpointing=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        log_every_n_steps=t.log_every_n_steps, val_check_interval=t.val_check_interval,
        enable_progress_bar=t.enable_progress_bar and sys.stdout.isatty(),  # never into a log file
        enable_model_summary=False, default_root_dir=str(output_dir),
        plugins=[DCPCheckpointIO(find_callback(callbacks, TrainingState), int(t.checkpoint.chunk_mb * 2**20))])
