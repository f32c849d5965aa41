"""Bytes of the collectives of each training step, by category, as a callback (the counting:
:mod:`modules.comm_accounting`); DDP's dense all-reduce goes through its hook in ``trainer.comms.dense``."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from modules.comm_accounting import CommCounter, ddp_counting_hook, install, uninstall
from modules.sharding.comm_precision import dense_allreduce_hook


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

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        link = pl_module.link  # a DDP inside a node (tables per node) crosses no link: fp32 there
        count_dense_allreduce(pl_module.model, "fp32" if link.copy_span > 1 else link.comms.dense)

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


def count_dense_allreduce(model: nn.Module, precision: str) -> None:
    """``model``'s DDP (if its dense part has one) all-reduces in ``precision`` over the DDP's own process group (all
    ranks, or one node's), counted: DDP's all-reduce runs in C++, so through a communication hook."""
    dense = getattr(model, "_dmp_wrapped_module", None)
    if isinstance(dense, DistributedDataParallel):
        dense.register_comm_hook((dense_allreduce_hook(precision), dense.process_group), ddp_counting_hook)
