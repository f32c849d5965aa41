"""The LightningModule: builds the sharded model, trains with BCE, evaluates AUC / logloss."""

from __future__ import annotations

from typing import Any, Mapping

import lightning as L
import torch
import torch.nn.functional as F

from modules.models import build_model
from modules.optimizers import OptimizerChain, OptimizerSpec, build_optimizer
from modules.sharding import shard_model
from pipeline.data.batches import CTRBatch
from pipeline.metrics import CTRMetrics


class CTRTask(L.LightningModule):
    def __init__(self, model: Mapping[str, Any], optim: Mapping[str, Any], topology: Mapping[str, Any]) -> None:
        super().__init__()
        self.model_cfg = dict(model)
        self.dense_optim = OptimizerSpec.from_mapping(optim["dense"], "optim.dense")
        self.embedding_optim = OptimizerSpec.from_mapping(optim["embedding"], "optim.embedding")
        self.topology = dict(topology)
        self.model: torch.nn.Module | None = None
        self.plan = None
        self.val_metrics = CTRMetrics()
        self.test_metrics = CTRMetrics()

    # -- model -----------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        spec = self.trainer.datamodule.feature_spec
        params = {k: v for k, v in self.model_cfg.items() if k != "name"}
        net = build_model(self.model_cfg["name"], spec, params, device=torch.device("meta"))
        device = self.trainer.strategy.root_device
        self.model, self.plan = shard_model(net, self.embedding_optim, self.topology, device)
        self.val_metrics.to(device)
        self.test_metrics.to(device)

    def forward(self, batch: CTRBatch) -> torch.Tensor:
        return self.model(batch.dense_features, batch.sparse_features)

    def transfer_batch_to_device(self, batch: CTRBatch, device: torch.device, dataloader_idx: int) -> CTRBatch:
        return batch.to(device, non_blocking=True)

    # -- steps -----------------------------------------------------------------------------------
    def training_step(self, batch: CTRBatch, batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.shape[0])
        return loss

    def _eval_step(self, batch: CTRBatch, metrics: CTRMetrics) -> None:
        n = batch.valid_rows  # may be 0 on some ranks for the padded last batch: update anyway, so
        logits = self(batch)   # every rank's metric state is defined when torchmetrics syncs it
        metrics.update(logits[:n], batch.labels[:n])

    def validation_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics)

    def test_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics)

    def _log_eval(self, prefix: str, metrics: CTRMetrics) -> None:
        for k, v in metrics.compute().items():
            self.log(f"{prefix}/{k}", v, prog_bar=k == "auc", sync_dist=True)
        metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test", self.test_metrics)

    # -- optimizers ------------------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Dense parameters, plus embedding tables whose optimizer is not fused into the backward."""
        dense, embedding = [], []
        for name, p in self.model.named_parameters():
            if getattr(p, "_in_backward_optimizers", None):
                continue  # updated by FBGEMM inside the backward
            (embedding if ".embedding_bags." in name else dense).append(p)
        dense_opt = build_optimizer(self.dense_optim, dense)
        if not embedding:
            return dense_opt
        return OptimizerChain({"dense": dense_opt, "embedding": build_optimizer(self.embedding_optim, embedding)})
