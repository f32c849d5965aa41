"""The one owner of "the best validation AUC": LR reduction on a plateau, early stopping, and the
best epoch's weights put back for testing.

After every validation (``monitor``, higher is better, as synced over the ranks):

* a new best (strictly greater) resets both counters and, with ``restore_best``, copies this rank's
  weights (its shards) to host memory;
* otherwise ``stale`` and ``wait`` count up. With ``plateau_factor``, ``stale`` reaching
  ``plateau_patience`` multiplies every learning rate by the factor (``CTRTask.set_lr_factor``; FuxiCTR's
  reduce-LR-on-plateau has patience 1) and starts ``stale`` again; with ``early_stopping_patience``,
  ``wait`` reaching it stops training (Lightning's ``EarlyStopping`` rule, min_delta 0).

At the end of fitting the best weights are restored (``restore_best``: early stopping's usual
companion), so the test split sees the best model. The counters, the factor and the best value are
saved with checkpoints (the weights copy is not: a resumed run restores its own best from then on).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from modules.embedding.table_views import reload_tables, sync_tables


class BestValidation(Callback):
    def __init__(self, monitor: str = "val/auc", plateau_factor: float | None = None, plateau_patience: int = 1,
                 early_stopping_patience: int | None = None, restore_best: bool = False) -> None:
        self.monitor = monitor
        self.plateau_factor, self.plateau_patience = plateau_factor, max(1, plateau_patience)
        self.early_stopping_patience, self.restore_best = early_stopping_patience, restore_best
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stale = 0
        self.wait = 0
        self.lr_factor = 1.0
        self._weights: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "stale": self.stale, "wait": self.wait,
                "lr_factor": self.lr_factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.stale, self.wait, self.lr_factor = state["stale"], state["wait"], state["lr_factor"]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.lr_factor != 1.0:  # resumed after a reduction
            pl_module.set_lr_factor(self.lr_factor)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None or trainer.sanity_checking:
            return
        value = float(value)
        if self.best is None or value > self.best:
            self.best, self.best_epoch, self.stale, self.wait = value, trainer.current_epoch, 0, 0
            if self.restore_best:
                sync_tables(pl_module.model)  # the views hold the rows the caches trained
                self._weights = {k: _copy(v) for k, v in pl_module.model.state_dict().items()}
        else:
            self.stale += 1
            self.wait += 1
            if self.plateau_factor and self.stale >= self.plateau_patience:
                self.lr_factor *= self.plateau_factor
                self.stale = 0
                pl_module.set_lr_factor(self.lr_factor)
            if self.early_stopping_patience is not None and self.wait >= self.early_stopping_patience:
                trainer.should_stop = True
        for logger in trainer.loggers:
            logger.log_metrics({"train/lr_factor": self.lr_factor}, step=trainer.global_step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._weights is None:
            return
        sync_tables(pl_module.model)  # nothing left in the caches to be written over the restored rows later
        for k, live in pl_module.model.state_dict().items():
            _restore(live, self._weights[k])
        reload_tables(pl_module.model)  # the caches held the last epoch's rows
        self._weights = None


def _copy(t: Any) -> Any:
    """This rank's part of ``t`` copied into host memory (a table in UVM or GPU memory is never cloned on the GPU)."""
    if hasattr(t, "local_shards"):  # ShardedTensor: this rank's shards
        return [s.tensor.detach().to("cpu", copy=True) for s in t.local_shards()]
    return t.detach().to("cpu", copy=True)


def _restore(live: Any, saved: Any) -> None:
    with torch.no_grad():
        if hasattr(live, "local_shards"):
            for shard, value in zip(live.local_shards(), saved):
                shard.tensor.copy_(value)
        else:
            live.copy_(saved)
