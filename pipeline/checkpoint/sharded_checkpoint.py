"""The callback that writes the run's checkpoints (:mod:`.dcp_io` does the writing) and keeps the newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from filelock import FileLock, Timeout
from lightning.pytorch.callbacks import Callback

from pipeline.checkpoint.discovery import complete_checkpoints
from pipeline.runtime.errors import CheckpointMismatchError


class ShardedCheckpoint(Callback):
    """Checkpoints every ``every_n_steps`` training steps, after the run's last step and at the end of every epoch,
    keeping the newest ``keep`` (see :mod:`pipeline.checkpoint`).

    The folder belongs to one run at a time: global rank 0 holds a lock file in it (``.lock``, released
    when the process ends, however it ends); a second run naming the same folder is refused."""

    def __init__(self, dirpath: str, every_n_steps: int | None = None, keep: int = 2) -> None:
        self.dirpath, self.every_n_steps, self.keep = dirpath, every_n_steps, max(1, keep)
        self._saved_step: int | None = None
        self._lock: FileLock | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self._lock is None:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(Path(self.dirpath) / ".lock"))
            try:
                self._lock.acquire(timeout=0)
            except Timeout:
                self._lock = None
                raise CheckpointMismatchError(f"trainer.checkpoint.dir={self.dirpath} is in use by another running "
                                              f"job; give this run its own folder") from None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._lock is not None and stage == "fit":
            self._lock.release()
            self._lock = None

    def save(self, trainer: L.Trainer) -> None:
        """A checkpoint of this step, unless one was just written (epoch end after a step's, preemption)."""
        if self._saved_step == trainer.global_step:
            return
        self._saved_step = trainer.global_step
        trainer.save_checkpoint(str(Path(self.dirpath) / f"step-{trainer.global_step:09d}"))
        if trainer.is_global_zero:
            for old in complete_checkpoints(self.dirpath)[:-self.keep]:
                trainer.strategy.checkpoint_io.remove_checkpoint(old)
        trainer.strategy.barrier("checkpoint pruning")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # and the run's last step (trainer.max_steps): written here, the checkpoint holds the epoch as unfinished; the
        # epoch-end one written after it would say finished, and a run resumed with more steps trained none
        if (self.every_n_steps and trainer.global_step % self.every_n_steps == 0) or \
                trainer.global_step == trainer.max_steps:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)
