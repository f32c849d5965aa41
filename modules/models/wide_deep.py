"""Wide & Deep (Cheng et al., DLRS 2016): a linear ("wide") model and an MLP ("deep") trained jointly.

    logit = b + Σ_f w_f[x_f] + <a, dense> + MLP([e_1 … e_F, dense])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from modules.embedding.sparse_arch import FeatureSpec, SparseArch
from modules.models.backward_overlap import ConcurrencyTuner, DeferredWeightGrads, overlap_lookup_backward
from modules.models.layers import MLP


class WideDeep(nn.Module):
    def __init__(self, spec: FeatureSpec, embedding_dim: int = 16, mlp: Sequence[int] = (400, 400, 400),
                 dropout: float = 0.0, batch_norm: bool = False, bn_momentum: float = 0.1, init_std: float = 0.01,
                 stack_tables: bool = False, onednn_mlp: bool = True, overlap_embedding_backward: bool = True,
                 table_precision: str = "fp32",
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(spec, embedding_dim, init_std, wide=True, device=device, stack=stack_tables,
                                     precision=table_precision)
        n_dense, n_cat = len(spec.dense), len(spec.sparse)
        self.dense_linear = nn.Linear(n_dense, 1) if n_dense else None
        deep_in = (n_cat * embedding_dim, n_dense) if n_dense else n_cat * embedding_dim
        self.mlp = MLP(deep_in, mlp, 1, dropout, batch_norm, bn_momentum, onednn=onednn_mlp)
        self.overlap_embedding_backward = overlap_embedding_backward
        self.overlap_tuner = ConcurrencyTuner()  # beside or first, by the measured step (backward_overlap.py)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        (emb, first_order), deferred = self.lookups(sparse)
        return self.wide_and_deep(emb, first_order, dense, deferred)

    def lookups(self, sparse: KeyedJaggedTensor) -> tuple[tuple[torch.Tensor, torch.Tensor], DeferredWeightGrads | None]:
        """The sparse arch's outputs as the dense part reads them, and what the MLP defers its weight
        gradients to when the lookups' backward overlaps them (:mod:`modules.models.backward_overlap`)."""
        return overlap_lookup_backward(self.sparse_arch(sparse), self.mlp, self.overlap_embedding_backward,
                                       self.overlap_tuner)

    def wide_and_deep(self, emb: torch.Tensor, first_order: torch.Tensor, dense: torch.Tensor,
                      deferred: DeferredWeightGrads | None = None) -> torch.Tensor:
        """``first_order + <a, dense> + MLP([e_1 … e_F, dense])`` for embeddings ``emb`` [B, F, D]."""
        deep_in = emb.flatten(1)
        if self.dense_linear is not None:
            first_order = first_order + self.dense_linear(dense).squeeze(1)
            deep_in = (deep_in, dense)  # the MLP's first layer takes the blocks: no concatenated copy
        return first_order + self.mlp(deep_in, deferred).squeeze(1)
