"""Dense building blocks shared by the models."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class MLP(nn.Sequential):
    """Linear → [BatchNorm] → ReLU → [Dropout] per hidden size; optional final Linear to ``out_dim``."""

    def __init__(self, in_dim: int, hidden: Sequence[int], out_dim: int | None = 1,
                 dropout: float = 0.0, batch_norm: bool = False, bn_momentum: float = 0.1) -> None:
        layers: list[nn.Module] = []
        d = in_dim
        for h in hidden:
            layers.append(nn.Linear(d, h))
            if batch_norm:
                layers.append(nn.BatchNorm1d(h, momentum=bn_momentum))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            d = h
        if out_dim is not None:
            layers.append(nn.Linear(d, out_dim))
        super().__init__(*layers)
        self.out_features = out_dim if out_dim is not None else d


def fm_interaction(emb: torch.Tensor) -> torch.Tensor:
    """Second-order factorization-machine term (Rendle, ICDM 2010), O(F·D):

    Σ_{i<j} <e_i, e_j> = ½ Σ_d [(Σ_i e_id)² − Σ_i e_id²].   ``emb``: [B, F, D] → [B]
    """
    square_of_sum = emb.sum(dim=1).pow(2)
    sum_of_square = emb.pow(2).sum(dim=1)
    return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)
