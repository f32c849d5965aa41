"""A Bloom filter over int64 keys: which sorted run may hold a key (:mod:`modules.embedding.ssd_tier.sorted_runs`).

    m = BITS_PER_KEY · n bits, k = HASHES positions per key by double hashing:
        g_i(x) = (h1(x) + i · h2(x)) mod m,  i = 0 … k − 1
    h1, h2: the two halves of a 64-bit mix of the key (SplitMix64's finaliser)
    false positives ≈ (1 − e^(−k/b))^k for b bits per key: 2.4 % at b = 8, k = 4; no false negatives

A lookup asks each run's filter before reading one of its pages, so a key costs a disk read only in the
run that holds it (and in about one run in forty that does not). Memory: ``BITS_PER_KEY`` bits per
record in the runs — it grows with the evicted rows, not with the tables' rows, which is why it replaced
a byte per table row naming each key's run (203 MB at tables 8× a 2 GiB limit: more than the caches).

Sources: B. H. Bloom, "Space/time trade-offs in hash coding with allowable errors", CACM 1970;
A. Kirsch and M. Mitzenmacher, "Less hashing, same performance: building a better Bloom filter", 2006;
the mix: S. Vigna's SplitMix64.
"""

from __future__ import annotations

import numpy as np

from modules.embedding.ssd_tier import native_loops

BITS_PER_KEY = 8
HASHES = 4
CHUNK = 1 << 16


def _halves(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = keys.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z >> np.uint64(32), (z & np.uint64(0xFFFFFFFF)) | np.uint64(1)


class BloomFilter:
    """:data:`BITS_PER_KEY` bits per key of ``keys`` (module docstring); ``native``: set and asked in C
    (:mod:`.native_loops`), else in numpy (the reference)."""

    def __init__(self, keys: np.ndarray, native: bool = False) -> None:
        self.bits = np.uint64(max(64, BITS_PER_KEY * len(keys)))
        self.words = np.zeros(-(-int(self.bits) // 8), dtype=np.uint8)
        self.native = native
        if native:
            native_loops.bloom_add(self.words, int(self.bits), HASHES, np.asarray(keys))
            return
        for a in range(0, len(keys), CHUNK):  # in chunks: a merged run's keys are millions (~100 B of temporaries each)
            at = self._positions(np.asarray(keys[a:a + CHUNK])).reshape(-1)
            np.bitwise_or.at(self.words, at >> np.uint64(3), np.left_shift(1, at & np.uint64(7)).astype(np.uint8))

    @property
    def nbytes(self) -> int:
        return self.words.nbytes

    def may_hold(self, keys: np.ndarray) -> np.ndarray:
        """[n] bool: False where the key is surely absent."""
        if self.native:
            return native_loops.bloom_may_hold(self.words, int(self.bits), HASHES, keys)
        at = self._positions(keys)
        return ((self.words[at >> np.uint64(3)] >> (at & np.uint64(7)).astype(np.uint8)) & 1).all(axis=1).astype(bool)

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        h1, h2 = _halves(keys)
        return (h1[:, None] + np.arange(HASHES, dtype=np.uint64)[None, :] * h2[:, None]) % self.bits
