"""Stopping at a step boundary on a preemption signal (:mod:`pipeline.runtime.signals`), with a checkpoint."""

from __future__ import annotations

import signal
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from pipeline.runtime.signals import SignalGuard


class StopOnSignal(Callback):
    """After each training step: if any rank got a preemption signal, checkpoint (``save``) and stop. Under k-step
    merging the ranks ask each other only at merge steps (every k: a round trip across a slow link costs a
    sizeable share of a step) and at the last step of an epoch or of the run.

    Where the guard handles SIGTERM (``trainer.preemption.signals``, the default), this replaces Lightning's SIGTERM
    handling for the whole of training: its handler is covered by the guard's, so its flag stays 0, and the
    broadcast of that flag from rank 0 that its epoch loop issues before every step (``_broadcast_sigterm_tensor``:
    a round trip over every rank, which on a slow link waits behind a merge in flight) is not issued."""

    def __init__(self, guard: SignalGuard, save: Any = None) -> None:
        self.guard, self.save = guard, save
        self.stopped_at_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.guard.install()  # over the handler Lightning installed at the start of fit
        loop = trainer.fit_loop.epoch_loop
        if signal.SIGTERM in self.guard.signals and hasattr(loop, "_broadcast_sigterm_tensor"):  # (Lightning 2.x)
            loop._broadcast_sigterm_tensor = _no_broadcast

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        merging = pl_module.link.merging
        last = trainer.is_last_batch or trainer.global_step == trainer.max_steps  # all ranks agree before test
        if merging.enabled and trainer.global_step % merging.k and not last:
            return
        if self.stopped_at_step is None and self.guard.agreed():
            self.guard.signum = self.guard.signum or signal.SIGTERM  # a rank that got none stops as its peers
            if self.save is not None:
                self.save(trainer)
            self.stopped_at_step = trainer.global_step
            trainer.should_stop = True


def _no_broadcast() -> None:
    """In place of Lightning's per-step broadcast of its SIGTERM flag (see :class:`StopOnSignal`)."""
