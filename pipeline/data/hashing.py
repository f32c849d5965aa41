"""Counter-based pseudo-random numbers: splitmix64 (Steele, Lea, Flood, OOPSLA 2014).

``z = x + 0x9E3779B97F4A7C15; z = (z ^ z>>30)·0xBF58476D1CE4E5B9; z = (z ^ z>>27)·0x94D049BB133111EB;
return z ^ z>>31`` (all mod 2^64). A pure function of its input, so per-row or per-id random values
(split assignment, hidden label-model weights) depend on the row/id alone, never on chunking.
"""

from __future__ import annotations

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray | int) -> np.ndarray:
    """Mix 64-bit integers elementwise (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_keys(*parts: np.ndarray | int) -> np.ndarray:
    """Hash a tuple of integer arrays (broadcast) into one uint64 array."""
    h = np.uint64(0)
    for p in parts:
        h = splitmix64(np.asarray(p, dtype=np.uint64) ^ splitmix64(h))
    return np.asarray(h, dtype=np.uint64)


def to_unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash → float64 uniform on [0, 1) (top 53 bits)."""
    return (np.asarray(h, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def to_normal(h: np.ndarray) -> np.ndarray:
    """uint64 hash → standard normal (Box–Muller on two uniforms derived from the hash)."""
    u1 = to_unit(h)
    u2 = to_unit(splitmix64(h))
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def fnv1a64_strings(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """64-bit FNV-1a (Fowler–Noll–Vo) of each byte string ``data[offsets[i]:offsets[i+1]]``:
    ``h = 0xcbf29ce484222325; for byte: h = (h ^ byte) · 0x100000001b3 (mod 2^64)``.
    Vectorised over strings, one step per byte position."""
    starts = offsets[:-1].astype(np.int64)
    lengths = np.diff(offsets).astype(np.int64)
    h = np.full(len(starts), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in range(int(lengths.max()) if len(lengths) else 0):
            m = lengths > p
            h[m] = (h[m] ^ data[starts[m] + p].astype(np.uint64)) * _FNV_PRIME
    return h
