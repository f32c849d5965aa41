"""AUC and logloss over a whole split, across ranks (torchmetrics syncs the states on compute)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC


class CTRMetrics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.auc = BinaryAUROC()
        self.logloss = MeanMetric()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = logits.detach().float(), labels.detach().float()
        self.auc.update(torch.sigmoid(logits), labels.long())
        self.logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))

    def compute(self) -> dict[str, float]:
        return {"auc": float(self.auc.compute()), "logloss": float(self.logloss.compute())}

    def reset(self) -> None:
        self.auc.reset()
        self.logloss.reset()
