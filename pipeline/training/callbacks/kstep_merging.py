"""k-step model merging as a callback (the algorithm: :mod:`modules.optim.kstep_merging`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from modules.optim.kstep_merging import KStepMerger, MergeConfig
from modules.optim.optimizers import replicated_parameters
from modules.sharding.replicated_tables import attach_table_merger, peer_group


class KStepMerging(Callback):
    """k-step model merging of the replicated parameters (:mod:`modules.optim.kstep_merging`): after every
    training step, and a final merge before validation, testing and at each epoch's end. A checkpoint merges
    nothing: each rank saves its replicas, the pass under way and any merge in flight, and a resumed run goes on
    from them as the uninterrupted run does. The period is the task's ``merging`` (resolved
    for the link when ``trainer.merging.k=auto``); a run that resolved to DDP merges nothing. With
    ``trainer.merging.tables=replicated|per_node`` the looked-up rows of the tables' copies are merged with the
    dense part, each shard with the ranks that hold it on the other nodes."""

    def __init__(self, ranks_per_node: int, timeout: timedelta | None = None) -> None:
        self.ranks_per_node = ranks_per_node
        self.timeout = timeout  # of an overlapped merge's own process group
        self.merger: KStepMerger | None = None
        self._saved: dict[str, Any] = {"steps": 0, "merges": 0}  # until training starts: as the checkpoint has it
        self._copy = 0  # which copy of the tables this rank's shards belong to

    def state_dict(self) -> dict[str, Any]:
        """The merger's state (:meth:`KStepMerger.state_dict`), saved per rank: checkpoints merge nothing. The tables'
        shards of the first copy are not repeated: the checkpoint's model holds them (DCP writes a replicated
        tensor from the lowest rank holding it: :mod:`pipeline.checkpoint.dcp_io`)."""
        if self.merger is None:
            return self._saved
        return self.merger.state_dict(tables=self._copy > 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = dict(state)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cfg: MergeConfig = pl_module.link.merging
        if not cfg.enabled:
            return
        params = [p for _, p in replicated_parameters(pl_module.model)]
        tables = attach_table_merger(pl_module.model, pl_module.link.comms.embedding_backward) \
            if cfg.copies else None
        span = pl_module.link.copy_span
        self.merger = KStepMerger(params, cfg, ranks_per_node=self.ranks_per_node, tables=tables,
                                  dense=pl_module.link.comms.dense, timeout=self.timeout,
                                  table_group=peer_group(span, self.timeout) if tables is not None and span > 1
                                  else None)
        self._copy = trainer.global_rank // span if tables is not None else 0
        self.merger.attach_optimizer(trainer.optimizers[0])
        if "params" in self._saved:  # resumed: each rank's replicas, their pass and any merge in flight
            self.merger.load_state_dict(self._saved)
        else:
            self.merger.steps, self.merger.merges = self._saved["steps"], self._saved["merges"]
        self._saved = {"steps": 0, "merges": 0}  # the loaded tensors (a copy of the tables, maybe) not kept

    def merge_if_dirty(self) -> None:
        if self.merger is not None:
            self.merger.merge_if_dirty()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.merger is not None:
            self.merger.after_step()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.merge_if_dirty()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.merge_if_dirty()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.merge_if_dirty()
