"""Where CowClip sits: on TorchRec's sharded lookups (global scope) or on each rank's pooled
outputs (local scope, :class:`modules.embedding.SparseArch`). :func:`install_cowclip` chooses.

Inside a ``ShardedEmbeddingBagCollection`` every rank runs one FBGEMM kernel module per group of
its shards (``_lookups[i]._emb_modules[j]``). After the input all-to-all that module receives the
ids its shards own for the *whole global batch*; its pooled output goes back through the output
all-to-all, whose backward divides the gradient by the world size. A forward hook that wraps that
output with :func:`modules.cowclip.apply_cowclip` therefore sees, for each id the shard owns, every
occurrence in the global batch in global-mean-loss units: exact CowClip over the global batch for
table-wise and row-wise shards (row-wise ids are shard-local rows, which is all grouping needs).

Data-parallel and column-wise shards do not see the whole global batch / the whole row; their
tables fall back to local scope (see :func:`attach_local_fallback_tables`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding

from modules.cowclip import CowClipConfig, CowClipStats, apply_cowclip, one_hot_ids, table_blocks
from modules.embedding import SparseArch, lookup_name

log = logging.getLogger(__name__)
EXACT_SHARDINGS = (TwPooledEmbeddingSharding, RwPooledEmbeddingSharding)


def _kernel_layout(kernel: nn.Module) -> list[tuple[str, int, int]]:
    """(lookup, first column, end column) of each input key position of a kernel's pooled output."""
    layout, col = [], 0
    for table in kernel.config.embedding_tables:
        for feature in table.feature_names:
            layout.append((lookup_name(table.name, feature), col, col + table.local_cols))
            col += table.local_cols
    return layout


def _make_hook(layout: list[tuple[str, int, int]], cfg: CowClipConfig, stats: CowClipStats):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return apply_cowclip(output, table_blocks(layout, one_hot_ids(inputs[0]), cfg), cfg, stats=stats)

    return hook


def attach_global_cowclip(model: nn.Module, cfg: CowClipConfig,
                          stats: CowClipStats) -> tuple[list[RemovableHandle], set[str]]:
    """Hook every table-wise / row-wise kernel; returns the handles and the tables left uncovered."""
    if not get_gradient_division():
        raise RuntimeError("global CowClip expects TorchRec's gradient division (set_gradient_division(True))")
    handles, uncovered = [], set()
    for module in model.modules():
        if not isinstance(module, ShardedEmbeddingBagCollection):
            continue
        for sharding, lookup in zip(module._embedding_shardings, module._lookups):
            lookup = getattr(lookup, "module", lookup)  # data-parallel lookups are DDP-wrapped
            for kernel in lookup._emb_modules:
                layout = _kernel_layout(kernel)
                names = {name for name, _, _ in layout if cfg.applies_to(name)}
                if not names:
                    continue
                if isinstance(sharding, EXACT_SHARDINGS):
                    handles.append(kernel.register_forward_hook(_make_hook(layout, cfg, stats)))
                else:
                    uncovered |= names
    if uncovered:
        log.warning("CowClip scope=global covers table-wise and row-wise shards only; %s use local scope",
                    sorted(uncovered))
    return handles, uncovered


def install_cowclip(model: nn.Module, cfg: CowClipConfig | None) -> tuple[dict[str, set[str]], CowClipStats]:
    """Attach CowClip (and the per-id L2 term) to a DMP-wrapped model.

    Returns the tables handled per scope and the statistics object the backward passes fill.
    """
    stats = CowClipStats()
    arches = [m for m in model.modules() if isinstance(m, SparseArch)]
    tables = {t for a in arches for t in a.lookup_names if cfg is not None and cfg.applies_to(t)}
    if not tables:
        return {"global": set(), "local": set()}, stats
    local = tables
    if cfg.scope == "global":
        _, local = attach_global_cowclip(model, cfg, stats)
    for arch in arches:
        arch.set_local_cowclip(cfg, local & set(arch.lookup_names), stats)
    return {"global": tables - local, "local": local}, stats
