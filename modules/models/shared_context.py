"""Scores of N candidates that share one context (a ranking request), the context's share computed once.

Every input column belongs to the context (one value for all candidates) or to the candidates. Each feature's
slice of the model's input x = [e_1 … e_F, dense] then comes from one side only, so x = x_c + x_k, with x_c (one row,
broadcast) zero on the candidates' features and x_k zero on the context's. Looked up as rows of their own — the
context's row with bags on its features only (its ids once), each candidate's with empty bags where the context's
features are — the pooled embeddings are exactly those of the full rows (a feature's bag is whole on one side, empty,
hence zero, on the other). Then, with C and K the context's and the candidates' columns of x:

- first order (Wide & Deep, DeepFM, DCN with ``wide``): Σ_f w_f[x_f] + <a, dense> = (context's terms) + (candidates')
- DeepFM's FM: with s = Σ_i e_i = s_c + s_k and q = Σ_i ‖e_i‖² = q_c + q_k,
      FM = ½ (‖s‖² − q) = ½ (‖s_c‖² − q_c) + ½ (‖s_k‖² − q_k) + <s_c, s_k>
- the MLP's first layer:  W x + b = (W_C x_C + b) + W_K x_K,  W_C x_C + b once, [1, h], broadcast to the N rows: the
  GEMM shrinks from N × |x| × h to N × |K| × h
- DCN-v2's first cross layer (``CrossNet``):  x_1 = x_0 ⊙ (W_0 x_0 + b_0) + x_0,  W_0 x_0 = W_0,C x_C + W_0,K x_K:
  the context's product once; the later layers mix both sides (x_l for l ≥ 1 depends on every column): computed
  whole. DCN's vector cross layers (x_0 (x_lᵀ w_l): a dot product a row) and the low-rank mixture of experts run
  whole on x_0 (their saving is small, or the algebra does not split through the gates).

Several requests score in one call: B contexts and the N candidates of all of them, ``owner`` [N] naming each
candidate's context; every context term above is then taken per candidate (row ``owner[n]`` of the [B, ·] context
products) instead of broadcast. Everything after the first layer (ReLU, batch norm in eval, the next layers, the head)
runs on the N rows as the model runs it. The scores equal the model's on the expanded rows up to float rounding (the
sums are taken in another order), checked for every model in ``tests/test_ranking.py``.

``dense=torch.bfloat16``: the candidates' side of the MLP's hidden layers runs in bf16 — its GEMMs (weights cast once
here; oneDNN accumulates in fp32) and the activations between them (the context's fp32 product is added in bf16) —
while the context's product, the cross network, the FM, the first-order terms, batch norm and the output layer of one
unit stay fp32. Where the CPU computes bf16 natively
(AVX512-BF16, AMX-BF16) a GEMM takes about half the time; the scores move by about 1e-3 (measured:
``benchmarks/serving.py --rank``, docs/model_use.md).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet

from modules.models.dcn import DCN
from modules.models.deepfm import DeepFM
from modules.models.wide_deep import WideDeep


class SharedContext:
    """``model`` (eval mode) split for one assignment of its features: ``context_sparse`` the indices of the sparse
    features (in the sparse arch's order) and ``context_dense`` those of the numeric ones that come from the context.
    The weight blocks are cut once here; :meth:`logits` then scores any number of candidates."""

    def __init__(self, model: nn.Module, context_sparse: Sequence[int], context_dense: Sequence[int],
                 dense: torch.dtype = torch.float32) -> None:
        if not isinstance(model, (WideDeep, DCN)):
            raise TypeError(f"{type(model).__name__}: no shared-context form (expected Wide & Deep, DeepFM or DCN)")
        self.model = model
        arch = model.sparse_arch
        fields, dim = arch.num_fields, arch.embedding_dim
        n_dense = self._first_layer().weight.shape[1] - fields * dim
        ctx_sparse, ctx_dense = set(context_sparse), set(context_dense)
        self.k_sparse = torch.tensor([f for f in range(fields) if f not in ctx_sparse], dtype=torch.long)
        self.c_sparse = torch.tensor(sorted(ctx_sparse), dtype=torch.long)
        self.k_dense = torch.tensor([j for j in range(n_dense) if j not in ctx_dense], dtype=torch.long)
        self.c_dense = torch.tensor(sorted(ctx_dense), dtype=torch.long)
        # the columns of x = [e_1 … e_F, dense] each side holds
        columns = torch.arange(fields * dim).view(fields, dim)
        self.c_cols = torch.cat([columns[self.c_sparse].reshape(-1), fields * dim + self.c_dense])
        self.k_cols = torch.cat([columns[self.k_sparse].reshape(-1), fields * dim + self.k_dense])
        first = self._first_layer()
        self.mlp_c, self.mlp_k = _blocks(first.weight, self.c_cols, self.k_cols)
        self.mlp_k = self.mlp_k.to(dense)
        self.mlp_bias = first.bias.detach()
        # the later hidden layers' weights in ``dense`` (an output layer of one unit stays fp32)
        self.hidden = {id(m): (m.weight.detach().to(dense), m.bias.detach().to(dense)) for m in list(model.mlp)[1:]
                       if isinstance(m, nn.Linear) and m.out_features > 1} if dense != torch.float32 else {}
        cross = getattr(model, "cross", None)
        self.cross_c = self.cross_k = None
        if isinstance(cross, CrossNet):
            self.cross_c, self.cross_k = _blocks(cross.kernels[0], self.c_cols, self.k_cols)

    def _first_layer(self) -> nn.Linear:
        first = self.model.mlp[0]
        if not isinstance(first, nn.Linear):
            raise TypeError(f"the MLP starts with {type(first).__name__}: expected a Linear layer")
        return first

    def _x(self, emb: torch.Tensor, dense: torch.Tensor, dense_idx: torch.Tensor) -> torch.Tensor:
        """One side's columns of x: its features' embeddings ``emb`` [B, |S|, D] flattened, then its numbers."""
        return torch.cat([emb.flatten(1), dense[:, dense_idx]], dim=1)

    @torch.no_grad()
    def logits(self, ctx: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
               cand: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
               owner: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N] of the candidates. ``ctx``: the B contexts' pooled embeddings [B, F, D] (zero on the candidates'
        features), first-order sums [B] (or None) and numbers [B, n_dense] (any value on the candidates' columns: not
        read); ``cand``: the same for the N candidates ([N, F, D] zero on the context's features, [N], [N, n_dense]);
        ``owner`` [N]: each candidate's context (None: one context, B = 1, for all)."""
        (emb_c, wide_c, dense_c), (emb_k, wide_k, dense_k) = ctx, cand

        def per_candidate(t: torch.Tensor) -> torch.Tensor:  # a context term [B, ...] for the N candidates
            return t if owner is None else t.index_select(0, owner)

        emb_c, emb_k = emb_c[:, self.c_sparse], emb_k[:, self.k_sparse]  # each side's own features: [B, |S|, D]
        x_c = self._x(emb_c, dense_c, self.c_dense)  # [B, |C|]
        x_k = self._x(emb_k, dense_k, self.k_dense)  # [N, |K|]
        dense_dtype = self.mlp_k.dtype
        context = torch.addmm(self.mlp_bias, x_c, self.mlp_c.t()).to(dense_dtype)  # W_C x_C + b: [B, h], once each
        first = (x_k.to(dense_dtype) @ self.mlp_k.t()).add_(per_candidate(context))
        deep = self._rest(first).float()
        model = self.model
        if isinstance(model, DCN):
            x0 = _whole(per_candidate(x_c), x_k, self.c_cols, self.k_cols)
            xw_c = None if self.cross_c is None else per_candidate(x_c @ self.cross_c.t())  # W_0,C x_C: [B, |x|]
            logit = model.head(torch.cat([self._cross(x0, xw_c, x_k), deep], dim=1)).squeeze(1)
            return logit if wide_k is None else logit + (per_candidate(wide_c) + wide_k)
        logit = deep.squeeze(1) + (per_candidate(wide_c) + wide_k)
        if model.dense_linear is not None:
            w = model.dense_linear.weight[0]
            logit = logit + per_candidate(model.dense_linear.bias + dense_c[:, self.c_dense] @ w[self.c_dense]) \
                + dense_k[:, self.k_dense] @ w[self.k_dense]
        if isinstance(model, DeepFM):
            s_c, s_k = emb_c.sum(dim=1), emb_k.sum(dim=1)  # [B, D], [N, D]
            fm_c = 0.5 * (s_c.pow(2).sum(1) - emb_c.pow(2).sum((1, 2)))
            fm_k = 0.5 * (s_k.pow(2).sum(1) - emb_k.pow(2).sum((1, 2)))
            logit = logit + per_candidate(fm_c) + fm_k + (s_k * per_candidate(s_c)).sum(1)  # + <s_c, s_k>
        return logit

    def _rest(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's layers after the first Linear, on its output ``x`` (eval mode: dropout passes, batch norm applies
        its running statistics); the hidden Linear layers in the ``dense`` precision, the activations kept in it
        between them (ReLU, dropout), batch norm and an output layer of one unit in fp32."""
        for layer in list(self.model.mlp)[1:]:
            if id(layer) in self.hidden:
                w, b = self.hidden[id(layer)]
                x = torch.nn.functional.linear(x.to(w.dtype), w, b)
            elif isinstance(layer, (nn.ReLU, nn.Dropout)):
                x = layer(x)
            else:
                x = layer(x.float())
        return x

    def _cross(self, x0: torch.Tensor, xw_c: torch.Tensor | None, x_k: torch.Tensor) -> torch.Tensor:
        """The cross network on x0 [N, |x|]: the first full layer's product split (module docstring); ``xw_c`` the
        context's part W_0,C x_C of each candidate ([1 or N, |x|]; None where the network has no full layer)."""
        cross = self.model.cross
        if xw_c is None:
            return cross(x0)
        xw = xw_c.expand(len(x_k), -1).addmm(x_k, self.cross_k.t())
        x_l = x0 * (xw + cross.bias[0].squeeze(-1)) + x0
        for layer in range(1, cross._num_layers):
            x_l = x0 * (x_l @ cross.kernels[layer].t() + cross.bias[layer].squeeze(-1)) + x_l
        return x_l


def _blocks(weight: torch.Tensor, c_cols: torch.Tensor, k_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight``'s columns of the context and of the candidates, each contiguous."""
    w = weight.detach()
    return w[:, c_cols].contiguous(), w[:, k_cols].contiguous()


def _whole(x_c: torch.Tensor, x_k: torch.Tensor, c_cols: torch.Tensor, k_cols: torch.Tensor) -> torch.Tensor:
    """x [N, |x|] from the two sides' columns (the context's [1 or N, |C|] broadcast)."""
    x = x_k.new_empty(len(x_k), len(c_cols) + len(k_cols))
    x[:, c_cols] = x_c.expand(len(x_k), -1)
    x[:, k_cols] = x_k
    return x


