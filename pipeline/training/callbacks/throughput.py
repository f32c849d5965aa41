"""Training throughput: samples per second over all ranks, validation time excluded."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn


class TrainThroughput(Callback):
    """Training samples per second (all ranks), validation time excluded.

    Logs ``train/samples_per_s`` per epoch; ``samples_per_s`` holds the whole run's figure, and
    ``samples_per_s_after_warmup`` the figure after this process's first ``warmup_steps`` steps, whose time is
    ``warmup_s`` (a GPU's first steps load kernels, set up cuBLAS and grow the allocator: at batch 65,536 a one-epoch
    run has a dozen steps, and those dominate the whole run's figure).
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        self.warmup_steps = warmup_steps
        self.samples = 0
        self.seconds = 0.0
        self.steps = 0
        self.warmup_s: float | None = None  # set once the warm-up steps are done
        self._warm_samples = 0
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

    @property
    def samples_per_s_after_warmup(self) -> float | None:
        """None where the run had no step after its warm-up."""
        seconds = self._elapsed()
        if self.warmup_s is None or seconds <= self.warmup_s or self.samples <= self._warm_samples:
            return None
        return (self.samples - self._warm_samples) / (seconds - self.warmup_s)

    def _elapsed(self) -> float:
        return self.seconds + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_samples, self._epoch_seconds = 0, 0.0
        self._start()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start()  # a run resumed mid-epoch starts its epoch without on_train_epoch_start

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        n = int(batch.labels.shape[0]) * trainer.world_size
        self.samples += n
        self._epoch_samples += n
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.warmup_s, self._warm_samples = self._elapsed(), self.samples

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # a validation inside fit (trainer.training is False here)
            self._start()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        if self._epoch_seconds:
            pl_module.log("train/samples_per_s", self._epoch_samples / self._epoch_seconds, sync_dist=True)
