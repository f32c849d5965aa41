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
    """Mix 64-bit integers elementwise (wrapping arithmetic); returns a new array."""
    z = np.array(x, dtype=np.uint64)
    if z.ndim == 0:
        with np.errstate(over="ignore"):
            z = z + _GAMMA
            z = (z ^ (z >> np.uint64(30))) * _M1
            z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))
    return _splitmix64_inplace(z)


def _splitmix64_inplace(z: np.ndarray) -> np.ndarray:
    t = np.empty_like(z)
    with np.errstate(over="ignore"):
        z += _GAMMA
        np.right_shift(z, np.uint64(30), out=t)
        z ^= t
        z *= _M1
        np.right_shift(z, np.uint64(27), out=t)
        z ^= t
        z *= _M2
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
    return z


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


def bytes_keys(offsets: np.ndarray, data: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """64-bit key of each byte string ``data[offsets[i]:offsets[i+1]]`` (``valid``: which are present;
    absent entries get key 0 here).

    ``h = splitmix64(length); for each 8-byte little-endian word w (the last zero-padded):
    h = splitmix64(h ^ w)``. Vectorised over strings, one step per word; when every present string
    has the same length (Criteo's 8 hex digits) the data buffer is read as a matrix of words
    without gathering.
    """
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    present = n if valid is None else int(np.count_nonzero(valid))
    h = np.zeros(n, dtype=np.uint64)
    if present == 0:
        return h
    total = int(offsets[-1] - offsets[0])
    width = total // present
    if total == width * present and int(np.count_nonzero(lengths == width)) >= present:
        # fixed width (absent entries have length 0): the present strings lie back to back
        block = data[int(offsets[0]):int(offsets[-1])].reshape(present, width)
        if width % 8 or width == 0:
            block = np.concatenate([block, np.zeros((present, 8 - width % 8), np.uint8)], axis=1)
        words = np.ascontiguousarray(block).view("<u8")
        hp = np.full(present, splitmix64(np.uint64(width)), dtype=np.uint64)
        for k in range(words.shape[1] if width else 0):
            hp ^= words[:, k]
            _splitmix64_inplace(hp)
        if valid is None:
            return hp
        h[valid] = hp
        return h
    starts = offsets[:-1].astype(np.int64)
    lengths = lengths.astype(np.int64)
    mask = np.ones(n, dtype=bool) if valid is None else valid
    h[mask] = splitmix64(lengths[mask].astype(np.uint64))
    padded = np.concatenate([data, np.zeros(8, np.uint8)])
    shifts = np.arange(8, dtype=np.int64)
    for k in range(-(-int(lengths[mask].max()) // 8)):
        active = mask & (lengths > 8 * k)
        idx = starts[active] + 8 * k
        w = np.ascontiguousarray(padded[idx[:, None] + shifts]).view("<u8").ravel()
        rem = lengths[active] - 8 * k
        short = rem < 8
        w[short] &= (np.uint64(1) << (8 * rem[short]).astype(np.uint64)) - np.uint64(1)
        h[active] = splitmix64(h[active] ^ w)
    return h


def validity(column) -> np.ndarray | None:
    """Boolean mask of the non-null entries of an Arrow array (None when it has no nulls)."""
    if column.null_count == 0:
        return None
    bits = np.frombuffer(column.buffers()[0], dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[column.offset:column.offset + len(column)].astype(bool)


def string_keys(column) -> np.ndarray:
    """uint64 key (:func:`bytes_keys` of the UTF-8 bytes) of every value of an Arrow string array; 0 = missing."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.type == pa.large_string():
        off_dtype = np.int64
    else:
        column = column.cast(pa.string())
        off_dtype = np.int32
    bufs = column.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_dtype)[column.offset:column.offset + len(column) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    valid = validity(column)
    keys = bytes_keys(offsets, data, valid)
    keys[keys == 0] = 1  # 0 is reserved for "missing"
    if valid is not None:
        keys[~valid] = 0
    return keys
