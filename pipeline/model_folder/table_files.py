"""Embedding tables as raw files: row-major ``rows × cols`` (float32; uint8 rows of a quantized table,
:mod:`.quantize`), written in row blocks, read mapped.

A model folder keeps each table in ``tables/<parameter name>.f32`` (its shape in ``model.json``)
instead of inside ``weights.pt``, so writing, exporting and scoring never hold a whole table in
anonymous memory: writers copy row blocks of at most ``BLOCK_BYTES``; readers map the file
(``torch.from_file``, private mapping: pages come from the page cache as rows are looked up).

A sharded table at the end of training is written by every rank at once: rank 0 sizes the file,
each rank writes the blocks of its own shards at their offsets (``numpy.memmap``), rank 0 maps the
result. That needs the ranks to share the output folder's file system (one node, or a shared disk).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.runtime.launch import barrier, group_rank

BLOCK_BYTES = 64 << 20


def rows_per_block(row_bytes: int) -> int:
    """Rows of ``row_bytes`` bytes each that make one block to write."""
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def create(path: Path, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> None:
    """A sparse file of ``rows × cols`` zeros of ``dtype``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(rows * cols * dtype.itemsize)


def write_block(path: Path, shape: tuple[int, int], offsets: tuple[int, int], block: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> None:
    """Write ``block`` (a 2-D tensor, or rows of it) at ``offsets`` of the table file, in row blocks."""
    rows, cols = block.shape
    target = np.memmap(path, dtype=torch.empty(0, dtype=dtype).numpy().dtype, mode="r+", shape=shape)
    step = rows_per_block(dtype.itemsize * cols)
    r0, c0 = offsets
    for start in range(0, rows, step):
        part = block[start:start + step].detach().to("cpu", dtype).numpy()  # (a GPU shard: its rows copied to the host)
        target[r0 + start:r0 + start + len(part), c0:c0 + cols] = part
    target.flush()
    del target


def write(path: Path, table: torch.Tensor) -> None:
    """``table`` (2-D) as a new file, block by block."""
    create(path, *table.shape)
    write_block(path, tuple(table.shape), (0, 0), table)


def mapped(path: Path, shape: tuple[int, int] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The table file as a ``rows × cols`` tensor, private (copy-on-write: the file is never changed)."""
    rows, cols = shape
    expected = rows * cols * dtype.itemsize
    size = os.path.getsize(path)
    if size != expected:
        raise ValueError(f"{path}: {size} bytes, expected {expected} for a {rows} × {cols} {dtype} table")
    return torch.from_file(str(path), shared=False, size=rows * cols, dtype=dtype).view(rows, cols)


def is_sharded(value: Any) -> bool:
    return hasattr(value, "local_shards")


def holds_rank_0s_copy(value: Any) -> bool:
    """Whether this rank's sharded table belongs to the copy rank 0 is in (its process group holds rank 0): with the
    tables sharded over all ranks every rank does; with a copy on every rank or node
    (``trainer.merging.tables=replicated|per_node``; the copies agree after the final merge) only rank 0's node."""
    return not dist.is_initialized() or 0 in dist.get_process_group_ranks(value._process_group)


def unshard_to_file(value: Any, path: Path) -> torch.Tensor | None:
    """A (possibly sharded) 2-D table written to ``path`` by the ranks holding rank 0's copy of it (collective: every
    rank calls it; only rank 0's node need see ``path``); rank 0 gets the file mapped, other ranks None."""
    rank = group_rank()
    shape = tuple(value.size())
    if rank == 0:
        create(path, *shape)
    barrier()
    shards = (value.local_shards() if holds_rank_0s_copy(value) else []) if is_sharded(value) \
        else [None] if rank == 0 else []
    for shard in shards:
        if shard is None:
            write_block(path, shape, (0, 0), value)
        else:
            offsets = tuple(shard.metadata.shard_offsets)
            write_block(path, shape, (offsets[0], offsets[1] if len(offsets) > 1 else 0), shard.tensor)
    barrier()
    return mapped(path, shape) if rank == 0 else None
