"""Deep & Cross networks: a cross network and an MLP side by side over x0 = [e_1 … e_F, dense].

* DCN (Wang et al., ADKDD 2017), ``cross="vector"``: x_{l+1} = x0 · (x_lᵀ w_l) + b_l + x_l
* DCN-v2 (Wang et al., WWW 2021), ``cross="full"``: x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l, or with
  ``low_rank`` set, the low-rank mixture of ``num_experts`` experts (DCN-M, the reference's DCNMix):
  x_{l+1} = Σ_i G_i(x_l) · x0 ⊙ (U_i g(C_i g(V_iᵀ x_l)) + b_l) + x_l

    logit = wᵀ [cross(x0), MLP(x0)] + b  (+ Σ_f w_f[x_f] with ``wide``)

The cross layers are TorchRec's (``torchrec.modules.crossnet``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.modules.crossnet import CrossNet, LowRankMixtureCrossNet, VectorCrossNet

from modules.embedding.sparse_arch import FeatureSpec, SparseArch
from modules.models.backward_overlap import ConcurrencyTuner, overlap_lookup_backward
from modules.models.layers import MLP

CROSS_TYPES = ("vector", "full")


class DCN(nn.Module):
    def __init__(self, spec: FeatureSpec, embedding_dim: int = 16, mlp: Sequence[int] = (400, 400, 400),
                 dropout: float = 0.0, batch_norm: bool = False, bn_momentum: float = 0.1, init_std: float = 0.01, cross: str = "vector",
                 cross_layers: int = 3, low_rank: int | None = None, num_experts: int = 4, wide: bool = False,
                 stack_tables: bool = False, onednn_mlp: bool = True, overlap_embedding_backward: bool = True,
                 table_precision: str = "fp32",
                 device: torch.device | None = None) -> None:
        super().__init__()
        if cross not in CROSS_TYPES:
            raise ValueError(f"model.cross={cross!r}: expected one of {CROSS_TYPES}")
        self.sparse_arch = SparseArch(spec, embedding_dim, init_std, wide=wide, device=device, stack=stack_tables,
                                     precision=table_precision)
        width = len(spec.sparse) * embedding_dim + len(spec.dense)
        if cross == "vector":
            self.cross = VectorCrossNet(width, cross_layers)
        elif low_rank:
            self.cross = LowRankMixtureCrossNet(width, cross_layers, num_experts=num_experts, low_rank=low_rank)
        else:
            self.cross = CrossNet(width, cross_layers)
        self.mlp = MLP(width, mlp, None, dropout, batch_norm, bn_momentum, onednn=onednn_mlp)
        self.head = nn.Linear(width + self.mlp.out_features, 1)
        self.overlap_embedding_backward = overlap_embedding_backward
        self.overlap_tuner = ConcurrencyTuner()  # beside or first, by the measured step (backward_overlap.py)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        # the MLP's weight gradients beside the lookups' backward (modules/models/backward_overlap.py)
        (emb, wide), deferred = overlap_lookup_backward(self.sparse_arch(sparse), self.mlp,
                                                        self.overlap_embedding_backward, self.overlap_tuner)
        x0 = torch.cat([emb.flatten(1), dense], dim=1)
        logit = self.head(torch.cat([self.cross(x0), self.mlp(x0, deferred)], dim=1)).squeeze(1)
        return logit if wide is None else logit + wide
