"""L2 on every embedding row at every step (``optim.embedding_l2_scope=all``): the CowClip reference's
regularizer (bytedance/LargeBatchCTR: a Keras ``l2(λ)`` on the whole embedding matrix).

There every row w_k — in the batch or not — gets the gradient 2λ·w_k each step; CowClip then clips
each row to ``max(cnt_k, 1)·max(r‖w_k‖, floor)`` (``cnt_k`` = 0 for an absent row) and the optimizer
updates every row. A row absent from the batch therefore moves each step by

    g = 2λ·w                        (never clipped when 2λ ≤ r: ‖g‖ = 2λ‖w‖ ≤ r‖w‖ ≤ threshold)
    sgd:               w ← w − η·g
    adagrad:           s ← s + g²;        w ← w − η·g / (√s + ε)
    rowwise_adagrad:   s ← s + mean(g²);  w ← w − η·g / (√s + ε)
    adam (iteration t): m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
                        w ← w − η·(m / (1−β1^t)) / (√(v / (1−β2^t)) + ε)

With Adam's ε ≈ 1e-7 the step of a rarely seen row is ~η whatever λ, so its norm decays between
appearances and CowClip's threshold (∝ ‖w‖) becomes small for exactly the rare ids.

Two implementations of the same thing, chosen per embedding kernel:

* :class:`DenseRowsL2` — tables whose gradient is a dense tensor (data-parallel tables updated by a
  ``torch.optim`` optimizer, :mod:`modules.optim.optimizers`): after the backward (and DDP's all-reduce)
  add 2λ·W to the whole gradient and clip every row with its global count (absent: 1). Exactly the
  reference; O(table) per step, like the dense gradient itself.
* :class:`LazyRowsL2` — tables updated inside FBGEMM's backward, where touching every row every step
  would cost O(table): each row remembers the last step applied to it. When its id next reaches the
  kernel that holds it (a forward pre-hook: after TorchRec's input all-to-all, so the ids of the
  whole global batch for table-wise and row-wise shards), the missed steps are replayed exactly —
  each with that step's learning rate — before the lookup; the row's own update (batch-scope L2
  term and clipping, :mod:`modules.optim.cowclip`) follows as usual. :meth:`LazyRowsL2.flush` brings every
  row up to date; it runs before evaluation, checkpoints and the end of training, so what is read
  or saved is what the dense version would hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec import KeyedJaggedTensor

from modules.embedding.ssd_tier.cached_tbe import CachedRowsTBE
from modules.optim.cowclip import CowClipConfig, CowClipStats, RowBuckets

L2_SCOPES = ("batch", "all")
FBGEMM_KINDS = {"EXACT_SGD": "sgd", "EXACT_ADAGRAD": "adagrad", "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
                "ADAM": "adam"}
STATES = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}
FLUSH_ROWS = 1 << 20  # rows brought up to date at once by a flush


@dataclass(frozen=True)
class DecayRule:
    """The optimizer that applies the L2-only gradient 2λ·w to an absent row (module docstring)."""

    kind: str                     # sgd | adagrad | rowwise_adagrad | adam
    l2: float                     # λ (scaled for the batch size)
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)


@torch.no_grad()
def replay_decay(w: torch.Tensor, states: Sequence[torch.Tensor], rule: DecayRule, first: torch.Tensor,
                 count: torch.Tensor, lrs: torch.Tensor, iteration0: int = 0) -> None:
    """Apply to each row r of ``w`` [R, d] (and its optimizer ``states``: [R] or [R, d] each) the
    ``count[r]`` L2-only steps ``first[r] … first[r] + count[r] − 1``, in place.

    ``lrs[j]``: the learning rate of step j; Adam's iteration of step j is ``iteration0 + j + 1``.
    Rows are sorted by count so that step i of the replay works on a prefix (no masks).
    """
    if not len(count) or int(count.max()) <= 0:
        return
    order = torch.argsort(count, descending=True)
    rows, st = w[order], [s[order] for s in states]
    start, n = first[order], count[order].tolist()
    active = len(n)
    for i in range(n[0]):
        while active and n[active - 1] <= i:
            active -= 1
        x = rows[:active]
        step = start[:active] + i
        lr = lrs[step].to(x.dtype)[:, None]
        g = (2.0 * rule.l2) * x
        if rule.kind == "sgd":
            x -= lr * g
        elif rule.kind == "adagrad":
            s = st[0][:active]
            s += g * g
            x -= lr * g / (s.sqrt() + rule.eps)
        elif rule.kind == "rowwise_adagrad":
            s = st[0][:active]
            s += (g * g).mean(dim=1)
            x -= lr * g / (s.sqrt()[:, None] + rule.eps)
        else:  # adam
            m, v = st[0][:active], st[1][:active]
            t = (step + iteration0 + 1).to(torch.float64)[:, None]
            m.mul_(rule.betas[0]).add_((1 - rule.betas[0]) * g)
            v.mul_(rule.betas[1]).add_((1 - rule.betas[1]) * g * g)
            mhat = m / (1 - rule.betas[0] ** t).to(x.dtype)
            vhat = v / (1 - rule.betas[1] ** t).to(x.dtype)
            x -= lr * mhat / (vhat.sqrt() + rule.eps)
    w[order] = rows
    for s, part in zip(states, st):
        s[order] = part


def table_ids(features: KeyedJaggedTensor, tables: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """The ids (rows of the kernel's shard) each table's features carry in a kernel's input."""
    keys = features.keys()
    per_key = features.lengths().view(len(keys), -1).sum(dim=1).tolist()
    values = features.values().to(torch.int64)
    segments = dict(zip(keys, torch.split(values, per_key)))
    return [torch.cat([segments[f] for f in names]) if names else values[:0] for names in tables]


def _features_per_table(kernel: nn.Module) -> list[list[str]]:
    return [list(t.feature_names) for t in kernel.config.embedding_tables]


@dataclass
class _LazyKernel:
    module: nn.Module
    features: list[list[str]]       # per table of the kernel
    last: list[torch.Tensor]        # per table: [rows] the last step applied to each row
    iteration0: int | None = None   # FBGEMM's iteration count before step 0 (Adam's bias correction)


LAST_STEP = torch.int32  # LazyRowsL2: the last step of each table row, in host memory wherever the row lives


def row_state_bytes(l2_scope: str) -> int:
    """Host bytes per table row the embedding L2 term keeps (``optim.embedding_l2_scope``), for placement."""
    return LAST_STEP.itemsize if l2_scope == "all" else 0


class LazyRowsL2:
    """Replays the missed L2-only steps of fused tables' rows when they are next looked up (module
    docstring). ``begin_step`` before each training step; ``flush`` before anything reads the tables."""

    def __init__(self, rule: DecayRule) -> None:
        self.rule = rule
        self.kernels: list[_LazyKernel] = []
        self.step = -1            # the training step under way (or last done)
        self.lrs = torch.zeros(1024, dtype=torch.float64, device="cpu")

    def add(self, kernel: nn.Module) -> None:
        emb = kernel.emb_module
        kind = FBGEMM_KINDS.get(getattr(emb.optimizer, "name", ""))
        if kind != self.rule.kind:
            raise ValueError(f"optim.embedding_l2_scope=all: kernel optimizer {emb.optimizer} is not the "
                             f"configured {self.rule.kind}")
        if getattr(emb, "lxu_cache_weights", torch.empty(0, device="cpu")).numel():
            raise ValueError("optim.embedding_l2_scope=all: tables with a UVM cache (topology tier 'host' with "
                             "caching) are not supported by the lazy L2 replay; place them on the device")
        rows = [w.shape[0] for w in emb.split_embedding_weights()]
        entry = _LazyKernel(kernel, _features_per_table(kernel),
                            [torch.full((n,), -1, dtype=LAST_STEP, device="cpu") for n in rows])
        self.kernels.append(entry)
        kernel.register_forward_pre_hook(self._pre_hook(entry))

    def begin_step(self, step: int, lr: float) -> None:
        """Training step ``step`` (0-based, continuing after a resume) is about to run with rate ``lr``."""
        if self.step < 0 or step < self.step:  # first step of this process: every row is current
            for kernel in self.kernels:
                for t in kernel.last:
                    t.fill_(step - 1)
        if step >= len(self.lrs):
            grown = torch.zeros(max(step + 1, 2 * len(self.lrs)), dtype=torch.float64, device="cpu")
            grown[:len(self.lrs)] = self.lrs
            self.lrs = grown
        self.lrs[step] = lr
        self.step = step

    def restart_rows(self, module: nn.Module, table: int, rows: torch.Tensor) -> None:
        """``rows`` of a kernel's ``table`` start afresh before this step (:mod:`modules.embedding.row_reset`): no decay owed."""
        for kernel in self.kernels:
            if kernel.module is module:
                kernel.last[table][rows] = self.step - 1

    def _catch_up(self, kernel: _LazyKernel, table: int, rows: torch.Tensor, upto: int, cached: bool = True) -> None:
        """Apply the steps ``last + 1 … upto`` to ``rows`` of the kernel's ``table`` (through its row cache when
        the table has one and ``cached``; else in the table itself)."""
        last = kernel.last[table]
        count = upto - last[rows]
        pending = count > 0
        if not bool(pending.any()):
            return
        rows, count = rows[pending], count[pending]
        emb = kernel.module.emb_module
        n_states = STATES[self.rule.kind]
        if cached and isinstance(emb, CachedRowsTBE):
            weights, states, at = emb.rows_for_update(table, rows)
            states = states[:n_states]
        else:
            weights, at = emb.split_embedding_weights()[table], rows
            states = emb.split_optimizer_states()[table][:n_states] if n_states else []
        w, st = weights[at].float(), [s[at].float() for s in states]
        replay_decay(w, st, self.rule, last[rows] + 1, count, self.lrs, kernel.iteration0 or 0)
        weights[at] = w.to(weights.dtype)
        for s, new in zip(states, st):
            s[at] = new.to(s.dtype)
        last[rows] = upto

    def _pre_hook(self, kernel: _LazyKernel):
        def hook(module: nn.Module, inputs: tuple) -> None:
            if not torch.is_grad_enabled() or self.step < 0:  # training forwards only (eval: no grad)
                return
            if kernel.iteration0 is None and hasattr(module.emb_module, "iter"):
                kernel.iteration0 = int(module.emb_module.iter.item()) - self.step  # before this step's update
            for table, ids in enumerate(table_ids(inputs[0], kernel.features)):
                if ids.numel():
                    rows = torch.unique(ids)
                    self._catch_up(kernel, table, rows, self.step - 1)
                    kernel.last[table][rows] = self.step

        return hook

    @torch.no_grad()
    def flush(self) -> None:
        """Bring every row up to date with the last step run, in blocks of ``FLUSH_ROWS`` rows (a table in
        memory-mapped files is never copied whole; a row-cached one is brought up to date in its files, which
        the cache first writes every row to and afterwards reads again)."""
        if self.step < 0:
            return
        for kernel in self.kernels:
            emb = kernel.module.emb_module
            cached = isinstance(emb, CachedRowsTBE)
            if cached:
                emb.sync_to_file()
            for table, last in enumerate(kernel.last):
                for start in range(0, len(last), FLUSH_ROWS):
                    rows = torch.arange(start, min(len(last), start + FLUSH_ROWS), device="cpu")
                    self._catch_up(kernel, table, rows, self.step, cached=False)
            if cached:
                emb.reload()


@dataclass
class _DenseKernel:
    module: nn.Module
    features: list[list[str]]               # per table of the kernel
    clip: list[bool]                        # per table: CowClip applies
    counts: list[torch.Tensor]              # per table: [rows] occurrences in this step's (local) batch
    buckets: list[Callable | None]          # per table: rows → id-frequency buckets (statistics)


class DenseRowsL2:
    """Every row of data-parallel tables gets 2λ·w and clipping with its global count (module docstring):
    ``apply`` after the backward, before the optimizer steps."""

    def __init__(self, l2: float, clip: CowClipConfig, stats: CowClipStats) -> None:
        self.l2, self.clip, self.stats = l2, clip, stats
        self.kernels: list[_DenseKernel] = []

    def add(self, kernel: nn.Module, clipped_tables: set[str], buckets: RowBuckets | None = None) -> None:
        tables = kernel.config.embedding_tables
        entry = _DenseKernel(kernel, _features_per_table(kernel), [t.name in clipped_tables for t in tables],
                             [torch.zeros(w.shape[0], dtype=torch.int64, device="cpu")
                              for w in kernel.emb_module.split_embedding_weights()],
                             [buckets.lookup([(t.name, 0)]) if buckets is not None else None for t in tables])
        self.kernels.append(entry)

        def hook(module: nn.Module, inputs: tuple) -> None:
            if torch.is_grad_enabled():  # training forwards only (eval: no grad)
                for counts, ids in zip(entry.counts, table_ids(inputs[0], entry.features)):
                    counts += torch.bincount(ids.cpu(), minlength=len(counts))

        kernel.register_forward_pre_hook(hook)

    @torch.no_grad()
    def apply(self) -> None:
        for kernel in self.kernels:
            emb = kernel.module.emb_module
            if emb.weights.grad is None:  # no lookup this step: the L2 term alone
                emb.weights.grad = torch.zeros_like(emb.weights)
            grad = emb.weights.grad.view(-1)
            counts = kernel.counts
            if dist.is_initialized() and dist.get_world_size() > 1:  # the gradient is the global batch's
                total = torch.cat(counts)
                dist.all_reduce(total)
                counts = list(torch.split(total, [len(c) for c in counts]))
            for table, w in enumerate(emb.split_embedding_weights()):
                offset = int(emb.weights_physical_offsets[table])
                g = grad[offset:offset + w.numel()].view_as(w)
                g += (2.0 * self.l2) * w
                if kernel.clip[table] and self.clip.enabled:
                    cnt = counts[table]
                    factor, over = self.clip.clip_factor(g, w, cnt.clamp(min=1).to(w.device, w.dtype))
                    g *= factor[:, None]
                    present = (cnt > 0).nonzero().squeeze(1)
                    bucket_of = kernel.buckets[table]
                    self.stats.add(over[present.to(over.device)], bucket_of(present) if bucket_of is not None else None)
            for c in kernel.counts:
                c.zero_()
