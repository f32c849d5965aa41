"""Sharded tensors as row chunks for DCP: checkpoints of large tables in bounded memory.

DCP writes each shard of a ``ShardedTensor`` as one item and reads an item whole (its bytes, then
``torch.load``) before copying it into the target: a table shard of G bytes costs about 2·G of
memory on load, and a shard that is a view of a larger buffer (a TBE's flat weights) is cloned
whole on save. :func:`row_chunks` presents every shard as row blocks of at most ``max_bytes``
(views of the same storage): DCP then saves and loads chunk by chunk, and loading writes straight
into the live tensors — for a file-backed table (:mod:`modules.embedding.ssd_tier.files`) into its file, so a
table larger than memory checkpoints and resumes.

DCP (torch 2.14) also keeps every tensor it wrote referenced until the file is complete, and it
clones a view whose storage is larger than the view. A chunk of a file-backed table is therefore
handed over as a mapping of just its own bytes of the file (``numpy.memmap`` at the chunk's offset):
nothing is cloned and nothing accumulates. Chunks of in-memory tables are cloned, as before. The split is a pure function of the global
shard metadata, the same on every rank, so no communication is needed and a checkpoint written by
W processes is read on any number (DCP matches overlapping chunks).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

MAX_CHUNK_BYTES = 64 << 20


def _row_blocks(meta: ShardMetadata, row_bytes: int, max_bytes: int) -> list[ShardMetadata]:
    rows = meta.shard_sizes[0]
    per = max(1, max_bytes // max(1, row_bytes))
    if rows <= per:
        return [meta]
    return [ShardMetadata(shard_offsets=[meta.shard_offsets[0] + start, *meta.shard_offsets[1:]],
                          shard_sizes=[min(per, rows - start), *meta.shard_sizes[1:]], placement=meta.placement)
            for start in range(0, rows, per)]


def _own_mapping(view: torch.Tensor) -> torch.Tensor:
    """A contiguous view of a file-backed storage as a tensor mapping only its own bytes of that file
    (shared: writes reach the file); any other tensor as it is."""
    filename = view.untyped_storage().filename
    if filename is None or not view.is_contiguous():
        return view
    own = np.memmap(filename, dtype=np.dtype(str(view.dtype).removeprefix("torch.")), mode="r+",
                    offset=view.storage_offset() * view.element_size(), shape=tuple(view.shape))
    return torch.from_numpy(own)


def chunked(st: ShardedTensor, max_bytes: int = MAX_CHUNK_BYTES) -> ShardedTensor:
    """``st`` with every shard split into row blocks of at most ``max_bytes`` (views, no copy)."""
    meta = st.metadata()
    if len(meta.size) == 0:
        return st
    row_bytes = math.prod(meta.size[1:]) * meta.tensor_properties.dtype.itemsize
    global_shards = [m for s in meta.shards_metadata for m in _row_blocks(s, row_bytes, max_bytes)]
    if len(global_shards) == len(meta.shards_metadata):
        return st
    local = []
    for shard in st.local_shards():
        start = shard.metadata.shard_offsets[0]
        for block in _row_blocks(shard.metadata, row_bytes, max_bytes):
            offset = block.shard_offsets[0] - start
            local.append(Shard(_own_mapping(shard.tensor.narrow(0, offset, block.shard_sizes[0])), block))
    new_meta = ShardedTensorMetadata(shards_metadata=global_shards, size=meta.size,
                                     tensor_properties=meta.tensor_properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, new_meta)


def row_chunks(tensors: dict[str, Any], max_bytes: int = MAX_CHUNK_BYTES) -> dict[str, Any]:
    """The same mapping with every ``ShardedTensor`` chunked (:func:`chunked`); other values as they are."""
    return {k: chunked(v, max_bytes) if isinstance(v, ShardedTensor) else v for k, v in tensors.items()}
