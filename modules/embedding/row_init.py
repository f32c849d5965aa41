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

    u₁ = (x≫40 + ½)/2²⁴,  u₂ = (x mod 2²⁴ + ½)/2²⁴,  w = σ·√(−2 ln u₁)·cos(2π u₂),

with ln and cos as polynomials of float32 +, −, ×, ÷ and √ — operations IEEE 754 rounds exactly — in a fixed
order, so that the C loop (``row_init.c``, built by :mod:`modules.embedding.native_build`) and its numpy twin
(:func:`normal_rows_numpy`, where no C compiler is found) give the same bits on any machine:

    ln u = e·ln 2 + 2s(1 + z/3 + z²/5 + z³/7 + z⁴/9),  u = m·2^e, m ∈ [√½, √2), s = (m−1)/(m+1), z = s²;
    cos 2πu = ∓(cos x or sin x), x = 2π·q ≤ π/4 after exact reductions by symmetry
              (q ≤ ⅛: cos, else sin of ¼ − q), Taylor to x⁸ / x⁹ (error < 3·10⁻⁸; ln's < 2·10⁻⁹ relative).

(Until 2026-11-27 numpy's float32 ``log`` and ``cos``: their results differ between numpy's SIMD paths, so a C
loop could not match them. The C draws 3× faster than those and 10× faster than its twin (docs/ssd_tier.md): a row
cache draws each row it meets for the first time inside a training step, a host table all its rows before training.)

A table's key is the CRC-32 of its name, so a table keeps its values when it is stacked with others
(:func:`modules.embedding.sparse_arch.table_configs`: the stacked table is the tables' row ranges one after the
other, each drawn with its own key) and when a plan puts it on another rank or tier. Because any row
can be drawn alone, a file-backed table is never written at initialisation: the row cache
(:mod:`modules.embedding.ssd_tier.row_cache`) draws a row the first time it meets it.
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from modules.embedding import native_build

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


F = np.float32
DRAW_BLOCK_VALUES = 1 << 22  # float32 values drawn at once for a table not in host float32 (16 MiB)
SOURCE = Path(__file__).with_name("row_init.c")


def native() -> bool:
    """Whether the draws run in C here (else numpy: the same values, slower)."""
    return native_build.available(SOURCE, "rows are drawn by numpy (the same values, ~10x slower)")


def _ln(u: np.ndarray) -> np.ndarray:
    """ln u of float32 u > 0 (normal), as ``row_init.c``'s ``ln_f32``."""
    bits = u.view(np.uint32)
    e = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32).astype(F) - F(127)
    m = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(F)
    big = m > F(1.41421354)
    m = np.where(big, m * F(0.5), m)
    e = np.where(big, e + F(1), e)
    s = (m - F(1)) / (m + F(1))
    z = s * s
    p = (F(1) / F(9)) * z + F(1) / F(7)
    p = p * z + F(1) / F(5)
    p = p * z + F(1) / F(3)
    p = p * z + F(1)
    return e * F(0.693147182) + (s * p) * F(2)


def _cos_2pi(u: np.ndarray) -> np.ndarray:
    """cos 2πu of float32 u in (0, 1), a multiple of 2⁻²⁵, as ``row_init.c``'s ``cos_2pi_f32``."""
    d = np.abs(u - F(0.5))
    far = d > F(0.25)
    q = np.where(far, F(0.5) - d, d)
    sign = np.where(far, F(1), F(-1))
    use_sin = q > F(0.125)
    x = F(6.28318548) * np.where(use_sin, F(0.25) - q, q)
    y = x * x
    c = (F(1) / F(40320)) * y - F(1) / F(720)
    c = c * y + F(1) / F(24)
    c = c * y - F(0.5)
    c = c * y + F(1)
    s = (F(1) / F(362880)) * y - F(1) / F(5040)
    s = s * y + F(1) / F(120)
    s = s * y - F(1) / F(6)
    s = s * y + F(1)
    s = s * x
    return sign * np.where(use_sin, s, c)


def normal_rows_numpy(seed: int, key: int, rows: np.ndarray, dim: int, std: float) -> np.ndarray:
    """:func:`normal_rows` in numpy: the reference of (and the fallback for) ``row_init.c``."""
    i = rows[:, None] * np.uint64(dim) + np.arange(1, dim + 1, dtype=np.uint64)[None, :]
    x = _mix(_base(seed, key) + i * GAMMA)
    u1 = ((x >> np.uint64(40)).astype(F) + F(0.5)) * F(2.0 ** -24)
    u2 = ((x & np.uint64(0xFFFFFF)).astype(F) + F(0.5)) * F(2.0 ** -24)
    return (np.sqrt(F(-2.0) * _ln(u1)) * _cos_2pi(u2)) * F(std)


def draw_into(dst: torch.Tensor, dst_rows: torch.Tensor | None, seed: int, key: int, rows: torch.Tensor,
              table_dim: int, col0: int, std: float) -> None:
    """``dst[dst_rows[i]] = ``the initial values of row ``rows[i]`` of table ``key`` (``table_dim`` wide), columns
    ``col0 …`` (``dst``'s width; ``dst_rows`` None: row i) — in C where it builds, without a temporary."""
    if dst.device.type == "meta":  # a module built on meta (TorchRec shards it, then draws the shards)
        return
    rows = rows.to("cpu", torch.int64).contiguous()
    if dst.device.type != "cpu" or dst.dtype != torch.float32:
        # device memory or half-precision rows: drawn in float32 blocks on the host, then copied (rounded to dst's type)
        step = max(1, DRAW_BLOCK_VALUES // max(1, dst.shape[1]))
        for start in range(0, rows.numel(), step):
            block = torch.empty(min(step, rows.numel() - start), dst.shape[1], device="cpu")
            draw_into(block, None, seed, key, rows[start:start + step], table_dim, col0, std)
            where = slice(start, start + step) if dst_rows is None else dst_rows[start:start + step].to(dst.device)
            dst[where] = block.to(dst.device, dst.dtype)
        return
    cols, where = dst.shape[1], slice(None) if dst_rows is None else dst_rows
    if std == 0.0:
        dst[where] = 0.0
    elif native() and dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == torch.float32:
        at = None if dst_rows is None else dst_rows.contiguous().to(torch.int64)
        native_build.library(SOURCE).draw_rows(
            native_build.ptr(dst), ctypes.c_int64(cols), None if at is None else native_build.ptr(at),
            native_build.ptr(rows), ctypes.c_int64(rows.numel()), ctypes.c_uint64(int(_base(seed, key))),
            ctypes.c_int64(table_dim), ctypes.c_int64(col0), ctypes.c_int64(cols), ctypes.c_float(std))
    else:
        values = normal_rows_numpy(seed, key, rows.numpy().astype(np.uint64), table_dim, std)[:, col0:col0 + cols]
        dst[where] = torch.from_numpy(np.ascontiguousarray(values))


def normal_rows(seed: int, key: int, rows: np.ndarray | torch.Tensor, dim: int, std: float) -> torch.Tensor:
    """``[len(rows), dim]`` float32: the initial values of ``rows`` of table ``key`` (module docstring)."""
    rows = torch.as_tensor(np.asarray(rows, dtype=np.int64), device="cpu")
    out = torch.zeros(rows.numel(), dim, device="cpu")
    if std != 0.0 and rows.numel():
        draw_into(out, None, seed, key, rows, dim, 0, std)
    return out


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
        out = torch.empty(len(rows), dim, device="cpu")
        self.draw_into(out, None, rows, dim, 0)
        return out

    def draw_into(self, dst: torch.Tensor, dst_rows: torch.Tensor | None, rows: torch.Tensor, dim: int,
                  col0: int) -> None:
        """``dst[dst_rows[i]]`` (``dst_rows`` None: ``dst[i]``) = columns ``col0 …`` (``dst``'s width) of the
        initial values of physical row ``rows[i]`` of the ``dim``-wide table."""
        if len(self.segments) == 1:  # a plain table: its rows are the logical table's
            lo, _, key = self.segments[0]
            draw_into(dst, dst_rows, self.seed, key, rows - lo, dim, col0, self.std)
            return
        rows = rows.to("cpu")
        segment = torch.searchsorted(torch.tensor([hi for _, hi, _ in self.segments], device="cpu"), rows, right=True)
        at = torch.arange(len(rows), device="cpu") if dst_rows is None else dst_rows.to("cpu")
        for k in torch.unique(segment).tolist():
            lo, _, key = self.segments[k]
            mine = segment == k
            draw_into(dst, at[mine], self.seed, key, rows[mine] - lo, dim, col0, self.std)

    def fill_(self, local: torch.Tensor, first_row: int, first_col: int, dim: int) -> None:
        """Fill ``local`` (rows ``first_row…``, columns ``first_col…`` of the ``dim``-wide table) in blocks."""
        for a in range(0, local.shape[0], BLOCK_ROWS):
            b = min(local.shape[0], a + BLOCK_ROWS)
            self.draw_into(local[a:b], None, torch.arange(first_row + a, first_row + b, device="cpu"), dim, first_col)

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
