"""Bytes of the collectives of each training step, by category, as a callback (the counting:
:mod:`modules.comm_accounting`; DDP's dense all-reduce is counted by the hook the sharded model's DDP was given,
:func:`modules.sharding.comm_precision.dense_allreduce_in`)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from modules.comm_accounting import CommCounter, install, uninstall


class CommAccounting(Callback):
    """Bytes of the collectives issued during training steps, by category (:mod:`modules.comm_accounting`);
    logs ``comm/<category>_bytes_per_step`` and ``comm/total_bytes_per_step`` at each epoch's end."""

    def __init__(self) -> None:
        self.counter = CommCounter()
        self.steps = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            install()  # the collectives wrapped while this run trains; teardown unwraps them

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            uninstall()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.counter.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.counter.stop()
        self.steps += 1

    def bytes_per_step(self) -> dict[str, float]:
        steps = max(1, self.steps)
        out = {f"comm/{k}_bytes_per_step": v / steps for k, v in self.counter.bytes.items()}
        out["comm/total_bytes_per_step"] = sum(self.counter.bytes.values()) / steps
        return out

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for k, v in self.bytes_per_step().items():
            pl_module.log(k, v, sync_dist=True)

