"""Embedding tables held by every rank or by every node, merged sparsely across the copies.

``trainer.merging.tables=replicated``: every table whole on every rank. ``per_node``: every table on every node,
sharded over the node's ranks (TorchRec's all-to-all and DDP inside the node, none across the link); the copies are
the nodes, and each shard is merged with the same shard on the other nodes (the ranks of one local rank), as in
TorchRec's 2D parallelism (``DMPCollection``: sharded within a group, replicated across groups). Either way each rank
shards its collections over the group of the ranks one copy spans (:func:`copy_group`: its own, or its node's),
so fused kernels, optimizers, CowClip, checkpoints and export are those of sharded tables. A
:class:`~modules.optim.sparse_merging.TableMerger` holds the rank's shards and sees every training lookup of them
through a forward pre-hook on the kernels (after the input all-to-all: the ids are the shard's own rows).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BaseBatchedEmbeddingBag
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modules.optim.sparse_merging import TableMerger

_groups: dict[int, dist.ProcessGroup] = {}


def copy_group(span: int, timeout: timedelta) -> dist.ProcessGroup:
    """The ranks one copy of the tables spans (consecutive, ``span`` of them: 1, or a node's), this rank's among
    them (made once per span, collectively, on first call; ``timeout``: its collectives', the all-to-all and DDP
    inside a node included)."""
    if span not in _groups:
        _groups[span], _ = dist.new_subgroups(group_size=span, timeout=timeout)
    return _groups[span]


def peer_group(span: int, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """The ranks that hold the same shards as this one, one in each copy (every rank with span 1), in a process group
    of their own (made collectively; ``timeout``: its collectives')."""
    world = dist.get_world_size()
    if world % span:
        raise ValueError(f"world size {world} is not a multiple of {span} ranks per copy of the tables")
    peers, _ = dist.new_subgroups_by_enumeration([list(range(local, world, span)) for local in range(span)],
                                                 timeout=timeout, backend="gloo")
    return peers


def _kernels(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """(sharded collection, one of its lookup kernels on this rank) for every kernel of ``model``."""
    for module in model.modules():
        if isinstance(module, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            for lookup in module._lookups:
                for kernel in getattr(lookup, "_emb_modules", ()):
                    if not isinstance(kernel, (BaseBatchedEmbeddingBag, BaseBatchedEmbedding)):
                        raise ValueError(f"{type(kernel).__name__}: a table kernel the merge cannot read rows of "
                                         f"(expected TorchRec's batched kernels)")
                    yield module, kernel


def _shard_name(config: object) -> str:
    """A shard's name in the merger: its table's, with its first row and column when it is not the table's start."""
    offsets = config.local_metadata.shard_offsets if config.local_metadata else [0, 0]  # type: ignore[attr-defined]
    return config.name if not any(offsets) else f"{config.name}@{offsets[0]},{offsets[1]}"  # type: ignore[attr-defined]


def attach_table_merger(model: nn.Module, updates: str = "fp32") -> TableMerger:
    """A merger of every table shard of ``model`` on this rank (sharded over :func:`copy_group`), told each training
    lookup, sending its updates in ``updates`` precision (fp32 or fp16)."""
    kernels = list(_kernels(model))
    shards = {}
    for _, kernel in kernels:
        for config, weight in zip(kernel._config.embedding_tables, kernel.split_embedding_weights()):
            shards[_shard_name(config)] = weight
    merger = TableMerger(shards, updates)
    for collection, kernel in kernels:
        names = [_shard_name(c) for c in kernel._config.embedding_tables]
        first = torch.tensor([merger.first_row[names[t]] for t in kernel._feature_table_map], device="cpu")  # per feature

        def record(mod: nn.Module, args: tuple, collection: nn.Module = collection, first: torch.Tensor = first
                   ) -> None:
            if not collection.training:
                return
            kjt: KeyedJaggedTensor = args[0]  # each feature's ids: rows of its table's shard here
            merger.record_rows(kjt.values().to(torch.int64)
                               + first.repeat_interleave(torch.tensor(kjt.length_per_key(), device="cpu")))
        kernel.register_forward_pre_hook(record)
    return merger
