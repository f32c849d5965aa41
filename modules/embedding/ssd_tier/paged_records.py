"""A sorted run's records file (:mod:`modules.embedding.ssd_tier.sorted_runs`), laid out so that a lookup reads one page.

    page p (4 KiB): records p·K … p·K + K − 1, each its int64 key (two float32 words) then its floats;
                    K = ⌊4096 / record bytes⌋ (53 for a 16-wide row with row-wise Adagrad), the rest zeros

A record never straddles two pages, and a page says which keys it holds, so a key's page (from the
run's fences, each page's first key) is the only read a lookup makes; keys and records in two files
cost a page of keys and a page of records instead. (Measured on the 2× benchmark: the same step time
either way — the disk's queue, not the bytes, set the pace — so this halves the bytes read, not the
time.) Pages are asked of the kernel in parallel (``madvise(WILLNEED)``: :func:`prefetch`, and
:func:`prefetch_rows` for rows of the table files) and the file is mapped without read-around.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from pathlib import Path

import numpy as np
import torch

from modules.embedding.ssd_tier import native_loops

PAGE = 4096


class PagedRecords:
    """A run's records file: page p (:data:`PAGE` bytes) holds records p·K … p·K + K − 1, each its int64 key (as
    two float32 words) then its ``width`` floats, K = ⌊PAGE / record⌋, the rest of the page zeros — so a
    record never straddles two pages, and a page says which keys it holds. ``[a:b]``: the records (without
    their keys) of positions a … b − 1, read in order. ``native``: :meth:`find` in C (:mod:`.native_loops`),
    else in numpy (the reference)."""

    def __init__(self, mapped: mmap.mmap | None, n: int, width: int, native: bool = False) -> None:
        self.n, self.width, self.stride, self.native = n, width, 2 + width, native
        self.per_page = per_page(width)
        self.flat = np.frombuffer(mapped, dtype=np.float32) if mapped is not None else np.zeros(0, np.float32)
        self.map = mapped

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, rows: slice) -> np.ndarray:
        a, b, _ = rows.indices(self.n)
        if a >= b:
            return np.zeros((0, self.width), np.float32)
        k, words = self.per_page, PAGE // 4
        p0, p1 = a // k, (b - 1) // k + 1
        self.map.madvise(mmap.MADV_WILLNEED, p0 * PAGE, (p1 - p0) * PAGE)  # read in order: one request, not page faults
        pages = self.flat[p0 * words:p1 * words].reshape(p1 - p0, words)[:, :k * self.stride]
        return pages.reshape(-1, self.stride)[a - p0 * k:b - p0 * k, 2:]

    def find(self, keys: np.ndarray, fences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found [n] bool, their records) of ``keys`` ascending: the fences (each page's first key) give each
        key's page, whose pages are asked of the kernel at once; a binary search of the page's inline keys
        (all keys at once, ⌈log₂ K⌉ halvings) gives its place. One page read per key."""
        k, words = self.per_page, PAGE // 4
        if self.native and self.n:
            return native_loops.paged_find(self.flat, self.n, self.width, k, words, fences, keys)
        page = np.searchsorted(fences, keys, side="right") - 1
        inside = page >= 0
        page = np.maximum(page, 0)
        prefetch(self.map, np.unique(page[inside]) * PAGE, PAGE)
        base, count = page * words, np.minimum(k, self.n - page * k)  # records in each key's page
        lo, hi = np.zeros(len(keys), np.int64), np.where(inside, count, 0)
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) >> 1
            less = self._key(base + np.minimum(mid, hi - 1) * self.stride) < keys
            lo = np.where(active & less, mid + 1, lo)
            hi = np.where(active & ~less, mid, hi)
        at = base + np.minimum(lo, np.maximum(count - 1, 0)) * self.stride
        found = inside & (self._key(at) == keys) if len(keys) else np.zeros(0, bool)
        at = at[found]
        return found, self.flat[(at + 2)[:, None] + np.arange(self.width)]

    def _key(self, at: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.flat[at[:, None] + np.arange(2)]).view(np.int64).reshape(-1)


def per_page(width: int) -> int:
    """Records of ``width`` floats (+ their key) in one page."""
    return max(1, PAGE // ((2 + width) * 4))


def paged(keys: np.ndarray, records: np.ndarray, width: int) -> np.ndarray:
    """Whole pages of ``keys`` and ``records`` (:class:`PagedRecords`), the last one padded: [pages, PAGE / 4]
    float32, written to the file as it lies in memory."""
    k, stride = per_page(width), 2 + width
    n = len(keys)
    pages = -(-n // k)
    buf = np.zeros((pages, PAGE // 4), np.float32)
    out = buf[:, :k * stride].reshape(pages, k, stride)  # a view: the records are written into their pages
    words = np.ascontiguousarray(keys, dtype=np.int64).view(np.float32).reshape(n, 2)
    full, rest = divmod(n, k)
    out[:full, :, :2], out[:full, :, 2:] = words[:full * k].reshape(full, k, 2), records[:full * k].reshape(full, k, width)
    if rest:
        out[full, :rest, :2], out[full, :rest, 2:] = words[full * k:], records[full * k:]
    return buf


def mapped(path: Path, at_random: bool) -> mmap.mmap:
    """The file mapped read-only; ``at_random``: without read-around, so a page fault reads its page, not the
    128 KiB around it (records are looked up at random; read-around filled the page cache with neighbours
    nobody asked for). Files read in order (a run's keys) keep the kernel's read-ahead."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    if at_random:
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


def page_ranges(offsets: np.ndarray, size: int) -> list[tuple[int, int]]:
    """The pages (first, past last) covering ``[offset, offset + size)`` for every offset, runs of adjacent pages
    as one range."""
    if not len(offsets):
        return []
    pages = np.unique(np.concatenate([offsets // PAGE, (offsets + size - 1) // PAGE]))
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts, ends = pages[np.r_[0, breaks]], pages[np.r_[breaks - 1, len(pages) - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist()))


def prefetch(mapped: mmap.mmap, offsets: np.ndarray, size: int) -> None:
    """Ask the kernel to read the pages of ``[offset, offset + size)`` for every offset now, all at once: the
    disk serves them in parallel, where the page faults that follow would read one page at a time."""
    for a, b in page_ranges(offsets, size):
        mapped.madvise(mmap.MADV_WILLNEED, a * PAGE, (b - a) * PAGE)


def _libc_madvise():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None


MADVISE = _libc_madvise()  # for mappings Python's mmap did not make (torch.from_file); None off glibc/musl
MADV_RANDOM, MADV_WILLNEED = 1, 3  # <sys/mman.h>


def prefetch_rows(table: torch.Tensor, rows: np.ndarray) -> None:
    """:func:`prefetch` for ``rows`` of a memory-mapped tensor (its first dimension), by address."""
    if MADVISE is None or not len(rows) or not table.numel():
        return
    row_bytes = table.stride(0) * table.element_size()
    for a, b in page_ranges(table.data_ptr() + rows.astype(np.int64) * row_bytes, table[0].numel() * table.element_size()):
        MADVISE(ctypes.c_void_p(a * PAGE), ctypes.c_size_t((b - a) * PAGE), MADV_WILLNEED)
