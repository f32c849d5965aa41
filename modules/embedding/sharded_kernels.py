"""Where TorchRec put the FBGEMM kernels of a sharded model, and what each one holds.

Inside a ``ShardedEmbeddingBagCollection`` (or ``ShardedEmbeddingCollection``) every rank runs one
FBGEMM kernel module per group of its shards: ``_lookups[i]._emb_modules[j]``, data-parallel lookups
wrapped in DDP. Table-wise and row-wise kernels receive, after the input all-to-all, every id of the
global batch that their shards own (``EXACT_SHARDINGS``).
"""

from __future__ import annotations

from typing import Iterator

from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding

from modules.embedding.sparse_arch import lookup_name

EXACT_SHARDINGS = (TwPooledEmbeddingSharding, RwPooledEmbeddingSharding, TwSequenceEmbeddingSharding,
                   RwSequenceEmbeddingSharding)


def kernels(model: nn.Module) -> Iterator[tuple[nn.Module, object, nn.Module]]:
    """(sharded collection, its sharding, kernel) for every FBGEMM kernel module of a DMP model."""
    for module in model.modules():
        if isinstance(module, ShardedEmbeddingBagCollection):
            shardings = module._embedding_shardings
        elif isinstance(module, ShardedEmbeddingCollection):
            shardings = list(module._sharding_type_to_sharding.values())
        else:
            continue
        for sharding, lookup in zip(shardings, module._lookups):
            lookup = getattr(lookup, "module", lookup)  # data-parallel lookups are DDP-wrapped
            for kernel in lookup._emb_modules:
                yield module, sharding, kernel


def kernel_layout(kernel: nn.Module) -> list[tuple[str, int, int]]:
    """(lookup, first column, end column) of each input key position of a kernel's pooled output."""
    layout, col = [], 0
    for table in kernel.config.embedding_tables:
        for feature in table.feature_names:
            layout.append((lookup_name(table.name, feature), col, col + table.local_cols))
            col += table.local_cols
    return layout


def shard_tables(kernel: nn.Module) -> list[tuple[str, int]]:
    """(table, first row of this shard) of each table of a kernel (the ids it receives are shard rows)."""
    out = []
    for table in kernel.config.embedding_tables:
        meta = getattr(table, "local_metadata", None)
        out.append((table.name, int(meta.shard_offsets[0]) if meta is not None else 0))
    return out
