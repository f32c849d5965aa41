"""What a row cache works on and counts: the table (shard) behind it (:class:`BackingTable`: views of its rows
in the memory-mapped files and its initialiser), the cache's counts (:class:`CacheStats`), and a row as
one record (:func:`records`, :func:`split_records`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from modules.embedding.row_init import RowInit
from modules.embedding.ssd_tier.bloom import BITS_PER_KEY


MEMTABLE_PER_SLOTS = 16    # the sorted runs' memtable holds one evicted record per 16 cache slots
RUN_RECORDS_PER_SLOT = 16  # the sorted runs hold at most 16 records per cache slot, then are written home
ROW_INDEX_BYTES = 1 / 8    # per table row: whether it was ever written back


def slot_bytes(row_bytes: float) -> float:
    """Host memory of one cache slot: its row (``row_bytes``, with the optimizer state), the cache's key, last
    use, uses and dirty flag (8 + 4 + 4 + 1 bytes: the key is 4 bytes where the tier's rows number < 2^31,
    counted at 8 — placement stays on the safe side), its share of the memtable — records of row + 8-byte
    key, the memtable and its sorted copy while it is sealed — and of the runs' Bloom filters."""
    return row_bytes + 17 + 2 / MEMTABLE_PER_SLOTS * (row_bytes + 8) + RUN_RECORDS_PER_SLOT * BITS_PER_KEY / 8


@dataclass
class CacheStats:
    """Counts since the last :meth:`take` (rows are unique rows of a call)."""

    lookups: int = 0
    hits: int = 0
    rows_read: int = 0     # misses read from the file
    rows_drawn: int = 0    # misses never written to the file: drawn from their initialiser
    rows_written: int = 0  # dirty rows written back

    def add(self, other: "CacheStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def take(self) -> "CacheStats":
        out = CacheStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            setattr(self, f.name, 0)
        return out


@dataclass
class BackingTable:
    """The table (shard) behind a cache: views of its rows in the files, its initialiser, and where the shard
    sits in the whole table (first row and column, the table's width)."""

    weights: torch.Tensor        # [rows, D] (a view of the memory-mapped weights file)
    states: list[torch.Tensor]   # optimizer state views, [rows] or [rows, D]
    init: RowInit
    row_offset: int = 0
    col_offset: int = 0
    table_dim: int | None = None

    @property
    def rows(self) -> int:
        return self.weights.shape[0]

    def draw_into(self, dst: torch.Tensor, dst_rows: torch.Tensor | None, rows: torch.Tensor) -> None:
        """``dst[dst_rows[i]]`` (a slot table's rows; None: ``dst[i]``) = the initial values of the shard's
        ``rows[i]``."""
        self.init.draw_into(dst, dst_rows, rows + self.row_offset, self.table_dim or self.weights.shape[1],
                            self.col_offset)


def records(weights: torch.Tensor, states: list[torch.Tensor]) -> np.ndarray:
    """[n, D + state floats] float32: a row's weights then its optimizer state, one record per row."""
    n = weights.shape[0]
    return torch.cat([weights.reshape(n, -1), *[s.reshape(n, -1) for s in states]], dim=1).numpy()


def split_records(records: torch.Tensor, dim: int, states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Records back into (weights [n, dim], each state shaped as ``states``' rows)."""
    out, at = [], dim
    for s in states:
        width = s[0].numel() if s.dim() > 1 else 1
        part = records[:, at:at + width]
        out.append(part.reshape(-1) if s.dim() == 1 else part)
        at += width
    return records[:, :dim], out
