"""Initial embedding rows drawn from (seed, table, row), not from a random stream: the same values
wherever a row sits — host memory, a file, a row cache that first meets it mid-epoch — and on any
number of ranks.

Element ``(row r, column c)`` of a table with key ``k`` and width ``D`` is the ``i = r·D + c``-th output
of SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014)
seeded with ``base = mix(seed ⊕ mix(k))``:

    x_i = mix(base + (i + 1)·γ),  γ = 0x9E3779B97F4A7C15,
    mix(z): z ← (z ⊕ z≫30)·0xBF58476D1CE4E5B9;  z ← (z ⊕ z≫27)·0x94D049BB133111EB;  z ⊕ z≫31

(uint64 arithmetic mod 2⁶⁴), and the Box–Muller transform of two 24-bit parts of it, in float32
(exact integers there; |w| ≤ 5.9σ):

    u₁ = (x≫40 + ½)/2²⁴,  u₂ = (x mod 2²⁴ + ½)/2²⁴,  w = σ·√(−2 ln u₁)·cos(2π u₂).

float32 rather than float64: 85M against 8–30M values/s here, which matters where the row cache draws
each row it meets for the first time inside a training step.

A table's key is the CRC-32 of its name, so a table keeps its values when it is stacked with others
(:func:`modules.embedding.sparse_arch.table_configs`: the stacked table is the tables' row ranges one after the
other, each drawn with its own key) and when a plan puts it on another rank or tier. Because any row
can be drawn alone, a file-backed table is never written at initialisation: the row cache
(:mod:`modules.embedding.ssd_tier.row_cache`) draws a row the first time it meets it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

GAMMA = np.uint64(0x9E3779B97F4A7C15)
M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
BLOCK_ROWS = 1 << 16  # rows drawn at once (bounded temporaries for tables of any size)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * M1
    z = (z ^ (z >> np.uint64(27))) * M2
    return z ^ (z >> np.uint64(31))


def table_key(name: str) -> int:
    """The key of a table's draws: the CRC-32 of its name."""
    return zlib.crc32(name.encode())


def _base(seed: int, key: int) -> np.uint64:
    k = _mix(np.array([key], dtype=np.uint64))
    return _mix(np.array([seed], dtype=np.uint64) ^ k)[0]


def normal_rows(seed: int, key: int, rows: np.ndarray | torch.Tensor, dim: int, std: float) -> torch.Tensor:
    """``[len(rows), dim]`` float32: the initial values of ``rows`` of table ``key`` (module docstring)."""
    rows = np.asarray(rows, dtype=np.uint64)
    if std == 0.0 or rows.size == 0:
        return torch.zeros(rows.size, dim)
    i = rows[:, None] * np.uint64(dim) + np.arange(1, dim + 1, dtype=np.uint64)[None, :]
    x = _mix(_base(seed, key) + i * GAMMA)
    u1 = ((x >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    u2 = ((x & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    w = np.sqrt(np.float32(-2.0) * np.log(u1)) * np.cos(np.float32(2.0 * np.pi) * u2) * np.float32(std)
    return torch.from_numpy(w)


@dataclass(frozen=True)
class RowInit:
    """A table's ``init_fn``: N(0, std²) rows drawn from (seed, table, row). ``segments`` lists the
    (first row, end row, key) of each logical table in the physical one (one for a plain table, one per
    table in the stacked table); ``std`` 0 gives zeros (the first-order tables)."""

    seed: int
    std: float
    segments: tuple[tuple[int, int, int], ...]

    @classmethod
    def of_tables(cls, seed: int, std: float, names: Sequence[str], rows: Sequence[int]) -> "RowInit":
        segments, start = [], 0
        for name, n in zip(names, rows):
            segments.append((start, start + n, table_key(name)))
            start += n
        return cls(seed, std, tuple(segments))

    def rows(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """``[len(rows), dim]``: the initial values of the physical ``rows`` (int64, any order)."""
        if len(self.segments) == 1:  # a plain table: its rows are the logical table's
            lo, _, key = self.segments[0]
            return normal_rows(self.seed, key, (rows - lo).numpy(), dim, self.std)
        out = torch.empty(len(rows), dim)
        for lo, hi, key in self.segments:
            mine = (rows >= lo) & (rows < hi)
            if bool(mine.any()):
                out[mine] = normal_rows(self.seed, key, (rows[mine] - lo).numpy(), dim, self.std)
        return out

    def fill_(self, local: torch.Tensor, first_row: int, first_col: int, dim: int) -> None:
        """Fill ``local`` (rows ``first_row…``, columns ``first_col…`` of the ``dim``-wide table) in blocks."""
        for a in range(0, local.shape[0], BLOCK_ROWS):
            b = min(local.shape[0], a + BLOCK_ROWS)
            block = self.rows(torch.arange(first_row + a, first_row + b), dim)
            local[a:b] = block[:, first_col:first_col + local.shape[1]]

    @torch.no_grad()
    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, ShardedTensor):
            dim = weight.size(1)
            for shard in weight.local_shards():
                offsets = shard.metadata.shard_offsets
                self.fill_(shard.tensor, int(offsets[0]), int(offsets[1]), dim)
        elif weight.dim() == 2:  # (a rank that holds no shard of the table gets an empty 1-d tensor)
            self.fill_(weight, 0, 0, weight.shape[1])
        return weight


@dataclass(frozen=True)
class DrawnLater:
    """The ``init_fn`` of a table whose rows are drawn when first met (a file-backed table behind the row
    cache): writes nothing; ``init`` is what the cache draws with."""

    init: RowInit

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return weight
