"""The ``ssd`` tier's row caches bring the next training batch's rows in while a step computes
(:mod:`modules.embedding.ssd_tier.rows_ahead`).

Right after the sparse lookups of training batch i (a forward hook on the model's
:class:`~modules.embedding.sparse_arch.SparseArch`), batch i+1 — the loader makes each batch once, and
:meth:`pipeline.data.batches.BatchLoader.peek` hands the same object to this look-ahead and to the trainer —
is laid out as each embedding collection will receive it (:meth:`SparseArch.inputs`), and each row cache
starts bringing its rows in, in a thread, while batch i's dense layers, backward and optimizer step run.

``topology.ssd.look_ahead=true`` (off by default: docs/ssd_tier.md has what it gained and lost on 2 cores), tables
on the ``ssd`` tier; one process (with several ranks a kernel's ids come from every rank's batch) and no
``model.zch`` (its admission rounds remap ids between steps): :func:`pipeline.config.check_runnable` refuses
the rest. At the end of training it prints how many results were taken and how many not.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from torch.utils.hooks import RemovableHandle

from modules.embedding.sparse_arch import SparseArch
from modules.embedding.ssd_tier.cached_tbe import bring_ahead, cached_tbes

log = logging.getLogger(__name__)


class NextBatchRows(L.Callback):
    """After each training step's sparse lookups, the next batch's rows start coming in (module docstring)."""

    def __init__(self) -> None:
        self._arch: SparseArch | None = None
        self._hook: RemovableHandle | None = None
        self._next: int | None = None  # the batch to bring in after this step's lookups
        self._loader: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.topology.ssd.look_ahead or not cached_tbes(pl_module.model):
            return
        if not hasattr(trainer.train_dataloader, "peek"):  # world size and model.zch: refused by check_runnable
            log.warning("topology.ssd.look_ahead: the training loader cannot peek; rows are brought in at each step")
            return
        self._arch = next(m for m in pl_module.model.modules() if isinstance(m, SparseArch))
        self._loader = trainer.train_dataloader
        self._hook = self._arch.register_forward_hook(self._after_lookups)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._next = batch_idx + 1

    def _after_lookups(self, module: SparseArch, inputs: Any, output: Any) -> None:
        if self._next is None or not torch.is_grad_enabled():  # once a training step; not in evaluation
            return
        batch, self._next = self._loader.peek(self._next), None
        if batch is not None:
            for collection, features in module.inputs(batch.sparse_features):
                bring_ahead(collection, features)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hook is None:
            return
        self._hook.remove()
        tbes = cached_tbes(pl_module.model)
        for tbe in tbes:
            tbe.ahead.drop()
        print(f"Row caches (rank {trainer.global_rank}): the next batch's rows brought in ahead for "
              f"{sum(t.ahead.taken for t in tbes):,} lookups ({sum(t.ahead.dropped for t in tbes):,} not used)", flush=True)
