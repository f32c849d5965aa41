"""DeepFM (Guo et al., IJCAI 2017): first-order + factorization machine + MLP over shared embeddings.

    logit = b + Σ_f w_f[x_f] + <a, dense> + Σ_{i<j} <e_i, e_j> + MLP([e_1 … e_F, dense])

That is Wide & Deep's logit plus the FM term, so DeepFM is :class:`WideDeep` (same parameters and
state-dict keys) with the FM added; the FM runs over the categorical embeddings only.
"""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

from modules.models.layers import fm_interaction
from modules.models.wide_deep import WideDeep


class DeepFM(WideDeep):
    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        (emb, first_order), deferred = self.lookups(sparse)
        return self.wide_and_deep(emb, first_order, dense, deferred) + fm_interaction(emb)
