"""Attaching CowClip and the per-id L2 term to a sharded model from outside, as forward hooks.

Which lookups: every ``emb_<t>`` and ``wide_<f>`` lookup of the tables / features ``scaling.cowclip.fields``
selects (all by default) gets the per-id L2 term 2λ·w_k when λ = ``optim.embedding_l2`` > 0; CowClip
clips the ``emb_<t>`` lookups, and the ``wide_<f>`` ones too with ``clip_wide`` (:func:`lookup_rules`).

Bag collection (one id per bag): the pooled output of a bag is its id's row, so the per-id function
sits on pooled outputs, one column block per key. Sequence collection (multi-hot bags, shared tables):
TorchRec returns one row per occurrence before :class:`modules.embedding.sparse_arch.SparseArch` pools them, so the
function sits on those rows, grouped by (table, id) over every occurrence of every feature reading the
table — the paper's cnt_k and Σ g over all occurrences, whatever the pooling (the pooling's 1/len is
part of each occurrence's gradient).

Where (the algorithm is :mod:`modules.optim.cowclip`):

* ``global`` scope — on TorchRec's sharded lookups. Inside a ``ShardedEmbeddingBagCollection`` every
  rank runs one FBGEMM kernel module per group of its shards (``_lookups[i]._emb_modules[j]``). After
  the input all-to-all that module receives the ids its shards own for the *whole global batch*; its
  pooled output goes back through the output all-to-all, whose backward divides the gradient by the
  world size. A forward hook that wraps that output with :func:`modules.optim.cowclip.apply_cowclip`
  therefore sees, for each id the shard owns, every occurrence in the global batch in
  global-mean-loss units: exact CowClip over the global batch for table-wise and row-wise shards
  (row-wise ids are shard-local rows, which is all grouping needs). Data-parallel and column-wise
  shards do not see the whole global batch / the whole row: their lookups fall back to local scope.
* ``local`` scope — on each rank's pooled outputs (:class:`modules.embedding.sparse_arch.PooledLookups`), over the
  rank's own batch, with ``grad_scale = l2_share = 1/W`` (see :mod:`modules.optim.cowclip`).

With ``optim.embedding_l2_scope=all`` the L2 term reaches every row (:mod:`modules.optim.embedding_l2`):
data-parallel kernels then get no per-id hook (the dense version adds the term and clips every row
itself, over the global batch), fused kernels keep theirs and get the lazy replay as a pre-hook.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrec import KeyedJaggedTensor
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

from modules.optim.cowclip import Block, CowClipConfig, CowClipStats, RowBuckets, apply_cowclip, one_hot_ids
from modules.embedding.sparse_arch import (
    EMB_PREFIX,
    STACKED_TABLE,
    WIDE_COLUMNS,
    WIDE_PREFIX,
    WIDE_SEQ_TABLE,
    WIDE_TABLE,
    SparseArch,
    lookup_field,
    lookup_name,
)
from modules.optim.embedding_l2 import DecayRule
from modules.optim.every_row_l2 import EveryRowL2, attach_every_row_l2
from modules.embedding.sharded_kernels import EXACT_SHARDINGS, kernel_layout, kernels, shard_tables

log = logging.getLogger(__name__)
TABLE_BITS = 40  # group key of an occurrence: table index << 40 | id


def lookup_rules(lookups: Iterable[str], cfg: CowClipConfig, l2: float) -> dict[str, bool]:
    """The lookups that get per-id treatment, each mapped to whether CowClip clips it (else: L2 only)."""
    rules = {}
    for name in lookups:
        if cfg.fields is not None and lookup_field(name) not in cfg.fields:
            continue
        clip = cfg.enabled and (cfg.clip_wide or not name.startswith(WIDE_PREFIX))
        if clip or l2 > 0:
            rules[name] = clip
    return rules


@dataclass
class CowClipHooks:
    """What :func:`attach_cowclip` attached: lookups per scope, the statistics the backward fills, handles,
    and with ``embedding_l2_scope=all`` the every-row L2 term (:mod:`modules.optim.every_row_l2`)."""

    global_lookups: set[str] = field(default_factory=set)
    local_lookups: set[str] = field(default_factory=set)
    stats: CowClipStats = field(default_factory=CowClipStats)
    handles: list[RemovableHandle] = field(default_factory=list)
    every_row_l2: EveryRowL2 | None = None  # with embedding_l2_scope=all (the training loop drives it)


def _lookup(buckets: RowBuckets | None, parts: list[tuple[str, int]]):
    return buckets.lookup(parts) if buckets is not None else None


def _global_hook(kernel: nn.Module, rules: dict[str, bool], cfg: CowClipConfig, l2: float, stats: CowClipStats,
                 buckets: RowBuckets | None):
    layout = kernel_layout(kernel)
    shards = [part for part, table in zip(shard_tables(kernel), kernel.config.embedding_tables)
              for _ in table.feature_names]
    bucket_of = [_lookup(buckets, [part]) for part in shards]

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        ids = one_hot_ids(inputs[0])
        blocks = [(start, stop, ids[j], rules[name], bucket_of[j]) for j, (name, start, stop) in enumerate(layout)
                  if name in rules]
        return apply_cowclip(output, blocks, cfg, l2, stats=stats)

    return hook


def _local_hook(arch: SparseArch, rules: dict[str, bool], cfg: CowClipConfig, l2: float, stats: CowClipStats,
                buckets: RowBuckets | None):
    own = [(STACKED_TABLE, 0)] * len(arch.bag_fields) if arch.stack else \
        [(EMB_PREFIX + arch.tables[f], 0) for f in arch.bag_fields]
    bucket_of = {False: [_lookup(buckets, [part]) for part in own],
                 True: [_lookup(buckets, [(WIDE_TABLE, 0)])] * len(arch.bag_fields)}

    def blocks(wide: bool, width: int, ids: torch.Tensor) -> list[Block]:
        names = [WIDE_PREFIX + f if wide else EMB_PREFIX + arch.tables[f] for f in arch.bag_fields]
        return [(j * width, (j + 1) * width, ids[j], rules[name], bucket_of[wide][j]) for j, name in enumerate(names)
                if name in rules]

    def hook(module: nn.Module, inputs: tuple, output: tuple) -> tuple:
        emb, wide = output
        ids = one_hot_ids(inputs[2])  # [K, B]: the emb keys, then the wide keys (rows of the shared table)
        world = dist.get_world_size() if dist.is_initialized() else 1
        emb = apply_cowclip(emb, blocks(False, arch.embedding_dim, ids), cfg, l2, 1.0 / world, 1.0 / world, stats)
        if wide is not None:
            wide = apply_cowclip(wide, blocks(True, WIDE_COLUMNS, ids[len(arch.bag_fields):]), cfg, l2,
                                 1.0 / world, 1.0 / world, stats)
        return emb, wide

    return hook


def occurrence_blocks(features: KeyedJaggedTensor, lookups: list[str], groups: list[int], width: int,
                      rules: dict[str, bool], bucket_of=None) -> list[Block]:
    """Blocks over unpooled rows (one per id of ``features``, key after key): key ``j`` makes lookup
    ``lookups[j]`` in table group ``groups[j]``; each row's id becomes ``group << 40 | id``, so rows of one
    table row group together across keys. One block of the rows to clip, one of the rows with L2 only."""
    per_key = features.lengths().view(len(lookups), -1).sum(dim=1)
    key = torch.repeat_interleave(torch.arange(len(lookups), device=per_key.device), per_key,
                                  output_size=features.values().numel())
    group = torch.tensor(groups, dtype=torch.int64, device=key.device)[key]
    ids = (group << TABLE_BITS) | features.values().to(torch.int64)
    blocks: list[Block] = []
    for clip in (True, False):
        chosen = torch.tensor([rules.get(name) is clip for name in lookups], device=key.device)[key]
        if bool(chosen.any()):
            blocks.append((0, width, torch.where(chosen, ids, torch.full_like(ids, -1)), clip, bucket_of))
    return blocks


def _unpooled_hook(arch: SparseArch, rules: dict[str, bool], cfg: CowClipConfig, l2: float, stats: CowClipStats,
                   buckets: RowBuckets | None):
    n = len(arch.seq_fields)
    tables = list(dict.fromkeys(arch.tables[f] for f in arch.seq_fields))
    emb_lookups = [EMB_PREFIX + arch.tables[f] for f in arch.seq_fields]
    emb_groups = [tables.index(arch.tables[f]) for f in arch.seq_fields]
    emb_buckets = _lookup(buckets, [(EMB_PREFIX + t, 0) for t in tables])
    wide_buckets = _lookup(buckets, [(WIDE_SEQ_TABLE, 0)])

    def hook(module: nn.Module, inputs: tuple, output: tuple) -> tuple:
        emb, wide = output
        features: KeyedJaggedTensor = inputs[2]  # the sequence keys, then their wide keys
        parts = features.split([n, n]) if wide is not None else [features]
        world = dist.get_world_size() if dist.is_initialized() else 1
        emb = apply_cowclip(emb, occurrence_blocks(parts[0], emb_lookups, emb_groups, arch.embedding_dim, rules,
                                                   emb_buckets), cfg, l2, 1.0 / world, 1.0 / world, stats)
        if wide is not None:  # one first-order table: ids are already its rows
            wide = apply_cowclip(wide, occurrence_blocks(parts[1], [WIDE_PREFIX + f for f in arch.seq_fields],
                                                         [0] * n, WIDE_COLUMNS, rules, wide_buckets),
                                 cfg, l2, 1.0 / world, 1.0 / world, stats)
        return emb, wide

    return hook


def _sequence_kernel_hook(kernel: nn.Module, rules: dict[str, bool], cfg: CowClipConfig, l2: float,
                          stats: CowClipStats, buckets: RowBuckets | None):
    """Global scope on a sharded sequence kernel: its input KJT holds the ids of its tables' features
    for the whole global batch; its output has one row per id."""
    table_of = {f: (i, t.name) for i, t in enumerate(kernel.config.embedding_tables) for f in t.feature_names}
    width = kernel.config.embedding_tables[0].local_cols
    bucket_of = _lookup(buckets, shard_tables(kernel))

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        features: KeyedJaggedTensor = inputs[0]
        keys = features.keys()
        lookups = [lookup_name(table_of[k][1], k) for k in keys]
        groups = [table_of[k][0] for k in keys]
        return apply_cowclip(output, occurrence_blocks(features, lookups, groups, width, rules, bucket_of), cfg, l2,
                             stats=stats)

    return hook


def _attach_global(model: nn.Module, rules: dict[str, bool], cfg: CowClipConfig, l2: float,
                   hooks: CowClipHooks, buckets: RowBuckets | None) -> set[str]:
    """Hook every table-wise / row-wise kernel; returns the handled lookups left uncovered."""
    if not get_gradient_division():
        raise RuntimeError("global CowClip expects TorchRec's gradient division (set_gradient_division(True))")
    uncovered: set[str] = set()
    for module, sharding, kernel in kernels(model):
        layout = kernel_layout(kernel)
        names = {name for name, _, _ in layout if name in rules}
        if not names:
            continue
        if isinstance(sharding, EXACT_SHARDINGS):
            hook = _global_hook(kernel, rules, cfg, l2, hooks.stats, buckets) \
                if isinstance(module, ShardedEmbeddingBagCollection) \
                else _sequence_kernel_hook(kernel, rules, cfg, l2, hooks.stats, buckets)
            hooks.handles.append(kernel.register_forward_hook(hook))
            hooks.global_lookups |= names
        else:
            uncovered |= names
    if uncovered:
        log.warning("CowClip scope=global covers table-wise and row-wise shards only; %s use local scope",
                    sorted(uncovered))
    return uncovered


def attach_cowclip(model: nn.Module, cfg: CowClipConfig, l2: float, l2_scope: str = "batch",
                   decay: DecayRule | None = None, buckets: RowBuckets | None = None) -> CowClipHooks:
    """Attach CowClip (``cfg``) and the L2 term (λ = ``l2``) to a DMP-wrapped model: on the ids of each
    batch (``l2_scope="batch"``) or on every row (``"all"``; ``decay`` names the embedding optimizer).
    ``buckets``: each row's id-frequency bucket, for the clipping statistics per bucket."""
    hooks = CowClipHooks()
    arches = [m for m in model.modules() if isinstance(m, SparseArch)]
    rules = lookup_rules({t for a in arches for t in a.lookup_names}, cfg, l2)
    if l2_scope == "all" and l2 > 0:
        if decay is None:
            raise ValueError("embedding_l2_scope=all needs the embedding optimizer's decay rule")
        hooks.every_row_l2, rules = attach_every_row_l2(model, rules, cfg, l2, decay, hooks.stats, buckets)
    if not rules:
        return hooks
    local = set(rules)
    if cfg.scope == "global":
        local = _attach_global(model, rules, cfg, l2, hooks, buckets)
    for arch in arches:
        mine = {name: clip for name, clip in rules.items() if name in local and name in arch.lookup_names}
        if mine:
            hooks.handles.append(arch.pooled.register_forward_hook(_local_hook(arch, mine, cfg, l2, hooks.stats,
                                                                               buckets)))
            if arch.ec is not None:
                hooks.handles.append(arch.unpooled.register_forward_hook(_unpooled_hook(arch, mine, cfg, l2,
                                                                                        hooks.stats, buckets)))
            hooks.local_lookups |= set(mine)
    return hooks
