"""Dense building blocks shared by the models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from modules.models.onednn_linear import applies, linear

if TYPE_CHECKING:
    from modules.models.backward_overlap import DeferredWeightGrads


class ConcatLinear(nn.Linear):
    """``nn.Linear`` over the concatenation of several inputs, applied block by block:

        y = b + [x_1 … x_K] Wᵀ = b + Σ_k x_k W_kᵀ,   W = [W_1 … W_K] split by columns

    Same parameters and state-dict keys as ``nn.Linear(Σ in_dims, out_features)``; ``forward`` takes
    the K inputs as a sequence. The concatenated copy is never made, and a block that needs no gradient
    (the dense features) costs no input-gradient GEMM. In DeepFM's first MLP layer (batch 8192) this
    replaces the 8192×400 @ 400×429 input-gradient GEMM, a shape MKL runs at half its usual rate on
    this AVX2 CPU, by an 8192×400 @ 400×416 one.
    """

    def __init__(self, in_dims: Sequence[int], out_features: int) -> None:
        super().__init__(sum(in_dims), out_features)
        self.in_dims = tuple(in_dims)

    def forward(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        if len(xs) != len(self.in_dims):
            raise ValueError(f"ConcatLinear expects {len(self.in_dims)} inputs of widths {self.in_dims}, got {len(xs)}")
        blocks = self.weight.split(self.in_dims, dim=1)
        y = torch.addmm(self.bias, xs[0], blocks[0].t())
        for x, w in zip(xs[1:], blocks[1:]):
            # in place: addmm's backward does not need its output; autocast does not cover addmm_, so the
            # block takes the output's dtype (bf16 under bf16-mixed, where addmm's output is bf16)
            y = y.addmm_(x.to(y.dtype), w.t().to(y.dtype))
        return y


class MLP(nn.Sequential):
    """Linear → [BatchNorm] → ReLU → [Dropout] per hidden size; optional final Linear to ``out_dim``.

    The ReLU runs in place: neither ``addmm`` nor batch norm keeps its output for the backward, so the
    activation overwrites it instead of writing a second [B, h] tensor (same values; ≈ 3 ms a step of
    the 400-400-400 MLP at batch 8,192 on 2 threads, docs/throughput.md).

    ``in_dim`` given as several widths makes the first layer a :class:`ConcatLinear`: the MLP then
    takes the inputs as a sequence instead of their concatenation.

    With ``onednn`` (``model.onednn_mlp``), each Linear (with its ReLU when one follows it directly) runs as
    one :func:`modules.models.onednn_linear.linear` call where that applies (fp32 CPU batches of at least
    64 rows): oneDNN's GEMM with the bias and ReLU fused, ≈ 5 % off the 400-400-400 MLP's step at batch
    8,192 on 2 cores; a :class:`ConcatLinear`'s blocks then run as one GEMM over their concatenation
    (oneDNN would copy the strided lookups anyway). The modules, parameters and state-dict keys stay
    those of the plain layers.
    """

    def __init__(self, in_dim: int | Sequence[int], hidden: Sequence[int], out_dim: int | None = 1,
                 dropout: float = 0.0, batch_norm: bool = False, bn_momentum: float = 0.1,
                 onednn: bool = True) -> None:
        layers: list[nn.Module] = []
        d: int | Sequence[int] = in_dim
        for h in hidden:
            layers.append(_linear(d, h))
            if batch_norm:
                layers.append(nn.BatchNorm1d(h, momentum=bn_momentum))
            layers.append(nn.ReLU(inplace=True))  # its input (a Linear / BatchNorm output) is not saved for backward
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            d = h
        if out_dim is not None:
            layers.append(_linear(d, out_dim))
        super().__init__(*layers)
        self.out_features = out_dim if out_dim is not None else (d if isinstance(d, int) else sum(d))
        self.onednn = onednn
        # (Linear, its ReLU right after it) pairs by position: what onednn_linear computes in one call
        self._fusable = {i for i in range(len(layers) - 1)
                         if isinstance(layers[i], nn.Linear) and isinstance(layers[i + 1], nn.ReLU)}
        # the pairs whose output a later Linear takes: its gradient comes from that Linear alone
        self._private = {i for i in self._fusable if any(isinstance(m, nn.Linear) for m in layers[i + 2:])}

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor],  # type: ignore[override]
                deferred: DeferredWeightGrads | None = None) -> torch.Tensor:
        """``deferred``: the weight gradients of the oneDNN layers are left to it
        (:func:`modules.models.backward_overlap.overlap_lookup_backward`)."""
        i = 0
        while i < len(self):
            layer = self[i]
            xs = [x] if isinstance(x, torch.Tensor) else x
            if self.onednn and isinstance(layer, nn.Linear) and applies(xs, layer.weight):
                slot = deferred.slot(layer.weight) if deferred is not None else None
                relu = i in self._fusable  # the ReLU right after it, in the same call
                x = linear(xs, layer.weight, layer.bias, relu, slot, private=i in self._private)
                i += 2 if relu else 1
            else:
                x, i = layer(x), i + 1
        return x

    def deferrable_weights(self) -> list[torch.Tensor]:
        """The weights whose gradients :meth:`forward` can leave to a :class:`DeferredWeightGrads`: those of
        the layers it may run on oneDNN."""
        return [self[i].weight for i in sorted(self._fusable)] if self.onednn else []


def _linear(in_dim: int | Sequence[int], out_dim: int) -> nn.Linear:
    return nn.Linear(in_dim, out_dim) if isinstance(in_dim, int) else ConcatLinear(in_dim, out_dim)


class _FMInteraction(torch.autograd.Function):
    """Forward and hand-written backward of :func:`fm_interaction`.

        y_b = ½ (‖s_b‖² − Σ_i ‖e_bi‖²),  s_b = Σ_i e_bi   ⇒   ∂y_b/∂e_bi = s_b − e_bi

    The backward writes one [B, F, D] tensor (a subtraction, then an in-place product) where
    autograd's graph of the forward makes five [B, F, D] passes (products, sums, their accumulation).
    """

    @staticmethod
    def forward(ctx: Any, emb: torch.Tensor) -> torch.Tensor:
        s = emb.sum(dim=1)
        ctx.save_for_backward(emb, s)
        return 0.5 * (s.pow(2).sum(dim=1) - torch.linalg.vector_norm(emb, dim=(1, 2)).pow(2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        emb, s = ctx.saved_tensors
        return (s.unsqueeze(1) - emb).mul_(grad[:, None, None])


def fm_interaction(emb: torch.Tensor) -> torch.Tensor:
    """Second-order factorization-machine term (Rendle, ICDM 2010), O(F·D):

    Σ_{i<j} <e_i, e_j> = ½ Σ_d [(Σ_i e_id)² − Σ_i e_id²].   ``emb``: [B, F, D] → [B]
    """
    return _FMInteraction.apply(emb)
