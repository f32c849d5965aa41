"""Attaching CowClip and the per-id L2 term to a sharded model from outside, as forward hooks.

Which lookups: every ``emb_<f>`` and ``wide_<f>`` lookup of the fields ``scaling.cowclip.fields``
selects (all by default) gets the per-id L2 term 2λ·w_k when λ = ``optim.embedding_l2`` > 0; CowClip
clips the ``emb_<f>`` lookups, and the ``wide_<f>`` ones too with ``clip_wide`` (:func:`lookup_rules`).

Where (the algorithm is :mod:`modules.cowclip`):

* ``global`` scope — on TorchRec's sharded lookups. Inside a ``ShardedEmbeddingBagCollection`` every
  rank runs one FBGEMM kernel module per group of its shards (``_lookups[i]._emb_modules[j]``). After
  the input all-to-all that module receives the ids its shards own for the *whole global batch*; its
  pooled output goes back through the output all-to-all, whose backward divides the gradient by the
  world size. A forward hook that wraps that output with :func:`modules.cowclip.apply_cowclip`
  therefore sees, for each id the shard owns, every occurrence in the global batch in
  global-mean-loss units: exact CowClip over the global batch for table-wise and row-wise shards
  (row-wise ids are shard-local rows, which is all grouping needs). Data-parallel and column-wise
  shards do not see the whole global batch / the whole row: their lookups fall back to local scope.
* ``local`` scope — on each rank's pooled outputs (:class:`modules.embedding.PooledLookups`), over the
  rank's own batch, with ``grad_scale = l2_share = 1/W`` (see :mod:`modules.cowclip`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding

from modules.cowclip import Block, CowClipConfig, CowClipStats, apply_cowclip, one_hot_ids
from modules.embedding import EMB_PREFIX, WIDE_COLUMNS, WIDE_PREFIX, SparseArch, lookup_field, lookup_name

log = logging.getLogger(__name__)
EXACT_SHARDINGS = (TwPooledEmbeddingSharding, RwPooledEmbeddingSharding)


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
    """What :func:`attach_cowclip` attached: lookups per scope, the statistics the backward fills, handles."""

    global_lookups: set[str] = field(default_factory=set)
    local_lookups: set[str] = field(default_factory=set)
    stats: CowClipStats = field(default_factory=CowClipStats)
    handles: list[RemovableHandle] = field(default_factory=list)


def _kernel_layout(kernel: nn.Module) -> list[tuple[str, int, int]]:
    """(lookup, first column, end column) of each input key position of a kernel's pooled output."""
    layout, col = [], 0
    for table in kernel.config.embedding_tables:
        for feature in table.feature_names:
            layout.append((lookup_name(table.name, feature), col, col + table.local_cols))
            col += table.local_cols
    return layout


def _global_hook(layout: list[tuple[str, int, int]], rules: dict[str, bool], cfg: CowClipConfig, l2: float,
                 stats: CowClipStats):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        ids = one_hot_ids(inputs[0])
        blocks = [(start, stop, ids[j], rules[name]) for j, (name, start, stop) in enumerate(layout) if name in rules]
        return apply_cowclip(output, blocks, cfg, l2, stats=stats)

    return hook


def _local_hook(arch: SparseArch, rules: dict[str, bool], cfg: CowClipConfig, l2: float, stats: CowClipStats):
    def blocks(prefix: str, width: int, ids: torch.Tensor) -> list[Block]:
        return [(j * width, (j + 1) * width, ids[j], rules[prefix + f])
                for j, f in enumerate(arch.fields) if prefix + f in rules]

    def hook(module: nn.Module, inputs: tuple, output: tuple) -> tuple:
        emb, wide = output
        ids = one_hot_ids(inputs[2])  # [K, B]: the emb keys, then the wide keys (rows of the shared table)
        world = dist.get_world_size() if dist.is_initialized() else 1
        emb = apply_cowclip(emb, blocks(EMB_PREFIX, arch.embedding_dim, ids), cfg, l2, 1.0 / world, 1.0 / world, stats)
        if wide is not None:
            wide = apply_cowclip(wide, blocks(WIDE_PREFIX, WIDE_COLUMNS, ids[arch.num_fields:]), cfg, l2,
                                 1.0 / world, 1.0 / world, stats)
        return emb, wide

    return hook


def _attach_global(model: nn.Module, rules: dict[str, bool], cfg: CowClipConfig, l2: float,
                   hooks: CowClipHooks) -> set[str]:
    """Hook every table-wise / row-wise kernel; returns the handled lookups left uncovered."""
    if not get_gradient_division():
        raise RuntimeError("global CowClip expects TorchRec's gradient division (set_gradient_division(True))")
    uncovered: set[str] = set()
    for module in model.modules():
        if not isinstance(module, ShardedEmbeddingBagCollection):
            continue
        for sharding, lookup in zip(module._embedding_shardings, module._lookups):
            lookup = getattr(lookup, "module", lookup)  # data-parallel lookups are DDP-wrapped
            for kernel in lookup._emb_modules:
                layout = _kernel_layout(kernel)
                names = {name for name, _, _ in layout if name in rules}
                if not names:
                    continue
                if isinstance(sharding, EXACT_SHARDINGS):
                    hooks.handles.append(kernel.register_forward_hook(_global_hook(layout, rules, cfg, l2, hooks.stats)))
                    hooks.global_lookups |= names
                else:
                    uncovered |= names
    if uncovered:
        log.warning("CowClip scope=global covers table-wise and row-wise shards only; %s use local scope",
                    sorted(uncovered))
    return uncovered


def attach_cowclip(model: nn.Module, cfg: CowClipConfig, l2: float) -> CowClipHooks:
    """Attach CowClip (``cfg``) and the per-id L2 term (λ = ``l2``) to a DMP-wrapped model."""
    hooks = CowClipHooks()
    arches = [m for m in model.modules() if isinstance(m, SparseArch)]
    rules = lookup_rules({t for a in arches for t in a.lookup_names}, cfg, l2)
    if not rules:
        return hooks
    local = set(rules)
    if cfg.scope == "global":
        local = _attach_global(model, rules, cfg, l2, hooks)
    for arch in arches:
        mine = {name: clip for name, clip in rules.items() if name in local and name in arch.lookup_names}
        if mine:
            hooks.handles.append(arch.pooled.register_forward_hook(_local_hook(arch, mine, cfg, l2, hooks.stats)))
            hooks.local_lookups |= set(mine)
    return hooks
