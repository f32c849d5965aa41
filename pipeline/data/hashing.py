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


def _fixed_width_words(offsets: np.ndarray, data: np.ndarray, present: int) -> np.ndarray | None:
    """[present, ceil(w/8)] little-endian 8-byte words (the last zero-padded) of the present strings
    when all of them have the same width ``w`` >= 1 (absent entries have length 0, so the present
    strings lie back to back); None otherwise. Width 8 is a view of ``data``, without a copy."""
    total = int(offsets[-1] - offsets[0])
    width = total // present
    if width == 0 or total != width * present or int(np.count_nonzero(np.diff(offsets) == width)) < present:
        return None
    block = data[int(offsets[0]):int(offsets[-1])].reshape(present, width)
    if width % 8:
        block = np.concatenate([block, np.zeros((present, 8 - width % 8), np.uint8)], axis=1)
    return np.ascontiguousarray(block).view("<u8")


def _mix_words(words: np.ndarray, width: int) -> np.ndarray:
    """:func:`bytes_keys` of equal-width strings given as their words [n, ceil(width/8)]."""
    h = np.full(len(words), splitmix64(np.uint64(width)), dtype=np.uint64)
    for k in range(words.shape[1]):
        h ^= words[:, k]
        _splitmix64_inplace(h)
    return h


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
    words = _fixed_width_words(offsets, data, present)
    if words is not None:
        hp = _mix_words(words, int(offsets[-1] - offsets[0]) // present)
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


def _string_buffers(column) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(offsets, UTF-8 data, validity mask or None) of an Arrow string array."""
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
    return offsets, data, validity(column)


def _reserve_missing(keys: np.ndarray, missing: np.ndarray | None) -> np.ndarray:
    keys[keys == 0] = 1  # 0 is reserved for "missing"
    if missing is not None:
        keys[missing] = 0
    return keys


def string_keys(column) -> np.ndarray:
    """uint64 key (:func:`bytes_keys` of the UTF-8 bytes) of every value of an Arrow string array; 0 = missing."""
    offsets, data, valid = _string_buffers(column)
    return _reserve_missing(bytes_keys(offsets, data, valid), None if valid is None else ~valid)


def factorize(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int32 code per key, distinct keys in order of first appearance): ``keys == distinct[codes]``
    (Arrow's ``dictionary_encode``: the same result as ``pandas.factorize``, twice as fast here)."""
    import pyarrow as pa

    encoded = pa.array(keys, pa.uint64()).dictionary_encode()
    return encoded.indices.to_numpy(), encoded.dictionary.to_numpy()


def factorized_string_keys(column) -> tuple[np.ndarray, np.ndarray]:
    """(int32 code per value, distinct keys) of an Arrow string array: ``string_keys(column) ==
    distinct[codes]``, codes numbered in order of first appearance (:func:`factorize`).

    When every present value has the same width of at most 8 bytes (Criteo's hex ids), the values are
    factorized by their raw 8-byte word — an injective stand-in for the key — and only the distinct
    words are hashed, ~10x fewer than the values; the result is the same.
    """
    offsets, data, valid = _string_buffers(column)
    n = len(offsets) - 1
    present = n if valid is None else int(np.count_nonzero(valid))
    words = _fixed_width_words(offsets, data, present) if present else None
    if words is None or words.shape[1] != 1:
        return factorize(string_keys(column))
    raw = words[:, 0]
    if valid is not None:
        if not raw.all():  # a value of NUL bytes would read as missing: take the general path
            return factorize(string_keys(column))
        full = np.zeros(n, dtype=np.uint64)
        full[valid] = raw
        raw = full
    codes, distinct_raw = factorize(raw)
    width = int(offsets[-1] - offsets[0]) // present
    keys = _mix_words(distinct_raw[:, None], width)
    return codes, _reserve_missing(keys, None if valid is None else distinct_raw == 0)
