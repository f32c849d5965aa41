"""Evicted rows written back to a log, not to their home in the table files.

A dirty row the row cache evicts (:mod:`modules.embedding.ssd_tier.row_cache`) is appended — its weights and
optimizer state as one float32 record — to the table batch's spill file, and an index (row → byte
offset; the newest wins) finds it when the row is missed again. Written home instead, hashed ids
scatter the evicted rows over the whole table: each dirties (and, in a sparse file, allocates) a 4 KiB
page of its own, and under a memory limit the kernel must write pages back before it can reclaim them
(about 60× the bytes changed at 68-byte rows; at tables 8× the limit this write-back was the step's
bottleneck, docs/scale.md). Appended, 60 rows share a page and the pages go out in order: a
log-structured store, as LSM trees and FASTER's hybrid log write their updates.

The home files are brought up to date when something reads them (:meth:`SpillLog.entries` applied by
:meth:`~modules.embedding.ssd_tier.row_cache.RowCache.flush`: checkpoints, the model folder, the every-row L2's
flush), and the log starts empty again (:meth:`SpillLog.clear`).

The index is, per table, sorted runs of (rows, offsets): each batch of spilled rows adds a run, and past
``RUNS`` runs they are merged into one — 16 bytes per row in the log. The log is bounded: once it holds
as many records as the cache has slots, the cache writes it home (sorted by row) and empties it, so the
index takes at most 16 bytes per slot (counted by placement with the slot,
:data:`modules.sharding.placement.SLOT_BOOKKEEPING_BYTES`) and the file stays small.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

RUNS = 16


class SpillLog:
    def __init__(self, path: Path, tables: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = 0
        self.records = 0  # appended since the last clear (a row appended twice counts twice)
        self.runs: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(tables)]

    def reserve(self, t: int, rows: np.ndarray, record_bytes: int) -> int:
        """Room for the records of table ``t``'s ``rows`` (sorted, unique) at the log's end; their offsets go
        into the index now (the bytes follow from :meth:`write`). Returns the first offset."""
        start = self.size
        self.size += len(rows) * record_bytes
        self.records += len(rows)
        runs = self.runs[t]
        runs.append((rows.astype(np.int64), start + np.arange(len(rows), dtype=np.int64) * record_bytes))
        if len(runs) > RUNS:
            self.runs[t] = [self.entries(t)]
        return start

    def write(self, start: int, records: np.ndarray) -> None:
        os.pwrite(self.fd, records.tobytes(), start)

    def find(self, t: int, rows: np.ndarray) -> np.ndarray:
        """The offset of each of table ``t``'s ``rows`` in the log (the newest), -1 where it has none."""
        out = np.full(len(rows), -1, dtype=np.int64)
        for run_rows, offsets in reversed(self.runs[t]):
            left = out < 0
            if not left.any():
                break
            at = np.minimum(np.searchsorted(run_rows, rows[left]), len(run_rows) - 1)
            found = run_rows[at] == rows[left]
            out[np.flatnonzero(left)[found]] = offsets[at[found]]
        return out

    def read_sorted(self, offsets: np.ndarray, record_floats: int, window: int = 32 << 20) -> torch.Tensor:
        """:meth:`read` of many records, ``offsets`` ascending: the log read in order, ``window`` bytes a call."""
        size = record_floats * 4
        out = np.empty((len(offsets), record_floats), dtype=np.float32)
        i = 0
        while i < len(offsets):
            start = int(offsets[i])
            j = i + int(np.searchsorted(offsets[i:], start + max(window, size) - size, side="right"))
            chunk = np.frombuffer(os.pread(self.fd, int(offsets[j - 1]) + size - start, start), dtype=np.uint8)
            at = (offsets[i:j] - start)[:, None] + np.arange(size)[None, :]
            out[i:j] = chunk[at].view(np.float32).reshape(j - i, record_floats)
            i = j
        return torch.from_numpy(out)

    def read(self, offsets: np.ndarray, record_floats: int) -> torch.Tensor:
        """[n, record_floats] float32 records at ``offsets``."""
        size = record_floats * 4
        out = np.empty((len(offsets), record_floats), dtype=np.float32)
        for i, offset in enumerate(offsets.tolist()):
            out[i] = np.frombuffer(os.pread(self.fd, size, offset), dtype=np.float32)
        return torch.from_numpy(out)

    def entries(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, offsets) of table ``t`` in the log, sorted by row, each row's newest record."""
        runs = self.runs[t]
        if not runs:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        rows = np.concatenate([r for r, _ in runs])
        offsets = np.concatenate([o for _, o in runs])
        order = np.lexsort((-offsets, rows))  # by row, newest first
        rows, offsets = rows[order], offsets[order]
        first = np.ones(len(rows), dtype=bool)
        first[1:] = rows[1:] != rows[:-1]
        return rows[first], offsets[first]

    def clear(self) -> None:
        self.runs = [[] for _ in self.runs]
        os.ftruncate(self.fd, 0)
        self.size = self.records = 0


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
