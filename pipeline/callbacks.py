"""Lightning callbacks of the pipeline."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class TrainThroughput(Callback):
    """Training samples per second (all ranks), validation time excluded.

    Logs ``train/samples_per_s`` per epoch; ``samples_per_s`` holds the whole run's figure.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._epoch_samples = 0
        self._epoch_seconds = 0.0
        self._t0: float | None = None

    def _start(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def _stop(self) -> None:
        if self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self._epoch_seconds += dt
            self.seconds += dt
            self._t0 = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_samples, self._epoch_seconds = 0, 0.0
        self._start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        n = int(batch.labels.shape[0]) * trainer.world_size
        self.samples += n
        self._epoch_samples += n

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training:
            self._start()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        if self._epoch_seconds:
            pl_module.log("train/samples_per_s", self._epoch_samples / self._epoch_seconds, sync_dist=True)


class RestoreBestWeights(Callback):
    """Keeps this rank's copy of the weights (its shards) from the best validation epoch and puts
    them back when fitting ends, so that testing sees the best model (early stopping's usual
    companion). The copy is in host memory: one more set of weights, no optimizer state."""

    def __init__(self, monitor: str = "val/auc", mode: str = "max") -> None:
        self.monitor, self.sign = monitor, 1.0 if mode == "max" else -1.0
        self.best: float | None = None
        self.best_epoch: int | None = None
        self._weights: dict[str, Any] | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None or trainer.sanity_checking:
            return
        value = float(value)
        if self.best is None or self.sign * value > self.sign * self.best:
            self.best, self.best_epoch = value, trainer.current_epoch
            self._weights = {k: _copy(v) for k, v in pl_module.model.state_dict().items()}

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._weights is None:
            return
        for k, live in pl_module.model.state_dict().items():
            _restore(live, self._weights[k])
        self._weights = None


def _copy(t: Any) -> Any:
    if hasattr(t, "local_shards"):  # ShardedTensor: this rank's shards
        return [s.tensor.detach().clone() for s in t.local_shards()]
    return t.detach().clone()


def _restore(live: Any, saved: Any) -> None:
    with torch.no_grad():
        if hasattr(live, "local_shards"):
            for shard, value in zip(live.local_shards(), saved):
                shard.tensor.copy_(value)
        else:
            live.copy_(saved)


class ShardedCheckpoint(Callback):
    """Checkpoints every ``every_n_steps`` training steps and at the end of every epoch, keeping the
    newest ``keep`` (see :mod:`pipeline.checkpointing`). Replicas are merged first (k-step merging)."""

    def __init__(self, dirpath: str, every_n_steps: int | None = None, keep: int = 2) -> None:
        self.dirpath, self.every_n_steps, self.keep = dirpath, every_n_steps, max(1, keep)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from pathlib import Path

        from pipeline.checkpointing import complete_checkpoints

        pl_module.merge_replicas()
        path = Path(self.dirpath) / f"step-{trainer.global_step:09d}"
        trainer.save_checkpoint(str(path))
        if trainer.is_global_zero:
            for old in complete_checkpoints(self.dirpath)[:-self.keep]:
                trainer.strategy.checkpoint_io.remove_checkpoint(old)
        trainer.strategy.barrier("checkpoint pruning")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer, pl_module)
        kill = getattr(pl_module, "debug", {}).get("kill_rank_at_step")
        if kill and trainer.global_step == kill[1] and trainer.global_rank == kill[0] and not pl_module.resumed:
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: a process dies mid-epoch (never after a resume)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module)
