"""CowClip: adaptive column-wise clipping of embedding gradients (Zheng et al., "CowClip: Reducing
CTR Prediction Model Training Time from 12 hours to 10 minutes on 1 GPU", AAAI 2023;
reference code bytedance/LargeBatchCTR).

For every id ``k`` present in the batch (column-wise = per embedding row):

    g_k    = Σ_{occurrences of k} ∂L/∂e_occ  (+ 2λ·w_k once, the per-id L2 term, before clipping)
    cnt_k  = occurrences of k in the batch
    clip_k = cnt_k · max(r·‖w_k‖, floor)          floor = ζ            ("zeta", the paper)
                                                  floor = r·√d·ζ      ("r_sqrt_d_zeta", the reference code)
    g_k   ← g_k · min(1, clip_k / ‖g_k‖)

How it reaches TorchRec's fused optimizers (there is no gradient tensor to clip: FBGEMM applies the
update inside the embedding backward): an identity autograd function sits on a pooled embedding
output whose bags hold one id each. In backward it sums the output gradients per id, computes the
factor, and returns ``factor_k · (grad_occ + 2λ·w_k / cnt_k)`` for every occurrence; the embedding
backward is linear in these, so the optimizer sees exactly the clipped ``g_k``. For a one-id bag
the pooled output *is* ``w_k``.

Scopes. ``global``: statistics over the global batch (the hook sits on the sharded lookups, see
:mod:`modules.optim.cowclip_hooks`), exactly the single-process algorithm at the global batch size.
``local``: every rank clips its own share of the gradient with its own counts (the function sits
on the rank's pooled output). This module is the algorithm; :mod:`modules.optim.cowclip_hooks` attaches it
to a model from outside. Both work in the units of the loss the optimizer finally applies,
the mean over the global batch: ``grad_scale`` is 1 on sharded lookups (TorchRec's all-to-all
backward has already divided by the world size W) and 1/W on a rank's pooled output (divided
later, by TorchRec or DDP). Locally each rank adds the share ``l2_share = 1/W`` of the L2 term,
so an id present on every rank gets exactly 2λ·w_k; a rank's clipped share is bounded by its
``cnt_k^r · max(r‖w_k‖, floor)``, whose sum over ranks is the global threshold. With W = 1 the two
scopes are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torchrec import KeyedJaggedTensor

FLOORS = ("zeta", "r_sqrt_d_zeta")
SCOPES = ("global", "local")


@dataclass
class CowClipConfig:
    """``scaling.cowclip``: the clipping rule and where it applies (the L2 term is ``optim.embedding_l2``)."""

    enabled: bool = False       # clip at all
    r: float = 1.0
    zeta: float = 1e-5
    floor: str = "zeta"
    scope: str = "global"       # global: per shard over the global batch; local: per rank's batch
    clip_wide: bool = False     # also clip the first-order ("wide_<f>") lookups (the L2 term applies to both)
    fields: Optional[List[str]] = None  # restrict clipping and the per-id L2 term to these fields (None: all)

    def __post_init__(self) -> None:
        if self.floor not in FLOORS:
            raise ValueError(f"floor={self.floor!r}: expected one of {FLOORS}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope={self.scope!r}: expected one of {SCOPES}")
        if self.r < 0 or self.zeta < 0:
            raise ValueError(f"r={self.r}, zeta={self.zeta}: expected values >= 0")

    def floor_value(self, dim: int) -> float:
        return self.zeta if self.floor == "zeta" else self.r * math.sqrt(dim) * self.zeta

    def clip_factor(self, g: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(factor, clipped?) per id, for per-id gradients ``g`` [n, d] of rows ``w`` [n, d] seen ``cnt`` [n]
        times: clip_t = cnt · max(r‖w‖, floor), factor = min(1, clip_t / ‖g‖)."""
        threshold = cnt * torch.clamp(self.r * w.norm(dim=1), min=self.floor_value(w.shape[1]))
        norm = g.norm(dim=1)
        over = norm > threshold
        return torch.where(over, threshold / norm.clamp_min(1e-30), torch.ones_like(norm)), over


BUCKET_EDGES = (10, 100, 1_000, 10_000)  # training-data occurrences of an id
BUCKET_LABELS = ("unknown", "lt10", "10-99", "100-999", "1k-9999", "ge10k")  # unknown: OOV/missing rows, hashed ids


def frequency_bucket(counts: torch.Tensor) -> torch.Tensor:
    """Bucket index (into ``BUCKET_LABELS``, int8: a byte per table row in host memory) of each row from its
    occurrence count (< 0: unknown)."""
    edges = torch.tensor(BUCKET_EDGES, dtype=counts.dtype, device=counts.device)
    return torch.where(counts < 0, 0, 1 + torch.bucketize(counts, edges, right=True)).to(torch.int8)


class CowClipStats:
    """Counts of (id, step) pairs seen and clipped, accumulated by the backward passes (for logging):
    in total, and per id-frequency bucket where the hooks know each row's bucket.

    The counts stay where the clipping ran (the GPU on CUDA) until they are read: a backward adds to them without
    waiting for the device; :meth:`take` and :meth:`take_buckets` bring them to the host."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None  # [2, 1 + buckets]: seen, clipped × (all, each bucket)

    def add(self, over: torch.Tensor, buckets: torch.Tensor | None = None) -> None:
        """One block's unique ids: ``over`` [U] clipped or not, ``buckets`` [U] their frequency buckets."""
        n = len(BUCKET_LABELS)
        if self._counts is None or self._counts.device != over.device:
            self._counts = torch.zeros(2, 1 + n, dtype=torch.int64, device=over.device)
        self._counts[0, 0] += over.numel()
        self._counts[1, 0] += over.sum()
        if buckets is not None:  # index_add_, not bincount: bincount sizes its output on the host
            b = buckets.to(over.device, torch.int64)
            self._counts[0, 1:].index_add_(0, b, torch.ones_like(b))
            self._counts[1, 1:].index_add_(0, b, over.to(torch.int64))

    @property
    def ids(self) -> int:
        """(id, step) pairs seen since the last :meth:`take` (a host read)."""
        return 0 if self._counts is None else int(self._counts[0, 0])

    @property
    def clipped(self) -> int:
        return 0 if self._counts is None else int(self._counts[1, 0])

    def take(self) -> float | None:
        """Fraction of clipped ids since the last call (None if no ids were seen); the totals start again."""
        if self._counts is None:
            return None
        ids, clipped = self._counts[:, 0].tolist()
        self._counts[:, 0] = 0
        return clipped / ids if ids else None

    def take_buckets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, clipped) per frequency bucket since the last call, on the host."""
        if self._counts is None:
            zeros = torch.zeros(len(BUCKET_LABELS), dtype=torch.int64, device="cpu")
            return zeros, zeros.clone()
        out = self._counts[:, 1:].to("cpu", copy=True)  # (.cpu() of a CPU tensor is the tensor itself)
        self._counts[:, 1:] = 0
        return out[0], out[1]


class RowBuckets:
    """Frequency bucket of every row of the tables (``"emb_<t>"``, ``"wide"``, ``"wide_seq"`` → [rows]),
    looked up for a block's ids. A block's id is ``group << 40 | row`` where ``group`` indexes the
    (table, first row of the shard) pairs the hook names (one pair, group 0, for a single table)."""

    def __init__(self, tables: dict[str, torch.Tensor]) -> None:
        self.tables = tables

    def lookup(self, parts: Sequence[tuple[str, int]]) -> "BucketOf | None":
        if not all(t in self.tables for t, _ in parts):
            return None
        return BucketOf([(self.tables[t], offset) for t, offset in parts])


class BucketOf:
    """Callable: block ids (``group << 40 | row``) → frequency buckets (see :class:`RowBuckets`)."""

    def __init__(self, parts: list[tuple[torch.Tensor, int]]) -> None:
        self.parts = parts

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The buckets of ``ids`` (on the host: the tables stay in host memory; on CUDA a copy of the ids, the one
        host synchronisation CowClip's statistics cost per lookup block)."""
        ids = ids.cpu()
        if len(self.parts) == 1:
            table, offset = self.parts[0]
            return table[ids + offset]
        group, row = ids >> 40, ids & ((1 << 40) - 1)
        out = torch.zeros_like(ids, dtype=torch.int8)
        for g, (table, offset) in enumerate(self.parts):
            mine = group == g
            out[mine] = table[row[mine] + offset]
        return out


def per_id_gradient(grad: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, clip: CowClipConfig | None,
                    l2: float = 0.0, grad_scale: float = 1.0, l2_share: float = 1.0,
                    stats: CowClipStats | None = None, bucket_of: Callable | None = None) -> torch.Tensor:
    """The per-occurrence gradients whose per-id sums are the clipped per-id gradients.

    ``grad``, ``rows``: [N, d] output gradients and looked-up rows of N one-id bags; ``ids``: [N].
    ``clip``: the clipping rule (None: no clipping); ``l2``: λ of the per-id L2 term (0: none);
    ``bucket_of``: ids → frequency buckets, for ``stats``.
    Returned in the units of ``grad``; the clipping itself happens on ``grad_scale ·`` Σ grad.
    """
    uniq, inv, cnt = torch.unique(ids, return_inverse=True, return_counts=True)
    d = grad.shape[1]
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    g = torch.zeros(len(uniq), d, dtype=acc, device=grad.device).index_add_(0, inv, grad.to(acc)) * grad_scale
    w = torch.zeros(len(uniq), d, dtype=acc, device=grad.device).index_copy_(0, inv, rows.to(acc))
    cntf = cnt.to(acc)
    if l2:
        g = g + (2.0 * l2 * l2_share) * w
    if clip is not None and clip.enabled:
        factor, over = clip.clip_factor(g, w, cntf)
        if stats is not None:
            stats.add(over, bucket_of(uniq) if bucket_of is not None else None)
    else:
        factor = torch.ones(len(uniq), dtype=acc, device=grad.device)
    out = grad.to(acc)
    if l2:
        out = out + (2.0 * l2 * l2_share / grad_scale) * w[inv] / cntf[inv, None]
    return (out * factor[inv, None]).to(grad.dtype)


def one_hot_ids(features: KeyedJaggedTensor) -> torch.Tensor:
    """[K, N] id of each key's bag (by key position; keys may repeat), -1 for an empty bag."""
    n, keys = features.stride(), features.keys()
    lengths = features.lengths().view(len(keys), n)
    if lengths.numel() and int(lengths.max()) > 1:
        bad = keys[int((lengths.max(dim=1).values > 1).nonzero()[0])]
        raise ValueError(f"CowClip needs one id per bag: feature {bad!r} has bags of up to {int(lengths.max())} ids "
                         "(pooled sums cannot be split per id; use single-id features)")
    ids = torch.full((len(keys), n), -1, dtype=torch.int64, device=lengths.device)
    present = lengths == 1
    ids[present] = features.values().to(torch.int64)
    return ids


Block = tuple  # (first column, end column, ids [N], clip?, ids → frequency buckets or None)


class _PerIdGradientFn(torch.autograd.Function):
    """Identity forward; backward rewrites the column blocks of the gradient (see ``Block``)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, blocks: Sequence[Block], clip: CowClipConfig | None, l2: float,
                grad_scale: float, l2_share: float, stats: CowClipStats | None) -> torch.Tensor:
        ctx.save_for_backward(out.detach())
        ctx.blocks, ctx.clip, ctx.l2, ctx.grad_scale, ctx.l2_share, ctx.stats = \
            blocks, clip, l2, grad_scale, l2_share, stats
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        (out,) = ctx.saved_tensors
        grad = grad.clone()
        for start, stop, ids, clip, bucket_of in ctx.blocks:
            valid = ids >= 0
            if valid.any():
                sel = valid.nonzero().squeeze(1)
                grad[sel, start:stop] = per_id_gradient(grad[sel, start:stop], out[sel, start:stop], ids[sel],
                                                        ctx.clip if clip else None, ctx.l2, ctx.grad_scale,
                                                        ctx.l2_share, ctx.stats, bucket_of)
        return grad, None, None, None, None, None, None


def apply_cowclip(out: torch.Tensor, blocks: Sequence[Block], clip: CowClipConfig | None, l2: float = 0.0,
                  grad_scale: float = 1.0, l2_share: float = 1.0, stats: CowClipStats | None = None) -> torch.Tensor:
    """``out`` unchanged forward; per-id L2 + clipping of the listed column blocks in backward."""
    if not blocks or not torch.is_grad_enabled() or not out.requires_grad:
        return out
    return _PerIdGradientFn.apply(out, list(blocks), clip, l2, grad_scale, l2_share, stats)
