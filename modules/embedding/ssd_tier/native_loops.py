"""The row cache's per-row loops in C (``cache_loops.c``), called with :mod:`ctypes`:

* :func:`assign` — a batch's unique ids to slots: lookup, victims, the slots' bookkeeping, in one pass
  instead of some twenty torch operations over [ids, W] temporaries (twin: :func:`.set_victims.place`);
* :func:`bloom_add`, :func:`bloom_may_hold` — a sorted run's Bloom filter (twin: :mod:`.bloom`);
* :func:`paged_find` — keys in a sorted run's records file (twin: :meth:`.paged_records.PagedRecords.find`).

Each twin computes the same thing in torch or numpy: it is the reference the tests compare the C with
(tests/test_native_loops.py) and what runs where no C compiler is found. Why: on a frequency-ordered table
larger than the day, about half a step's rows are met for the first time, and this per-row work in torch
and numpy — a few operations per row, each a pass over the batch — was most of the cache's time
(docs/ssd_tier.md).

The source is built on first use by :mod:`modules.embedding.native_build`.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from modules.embedding import native_build
from modules.embedding.native_build import ptr as _ptr
from modules.embedding.ssd_tier.set_victims import too_small

SOURCE = Path(__file__).with_name("cache_loops.c")
MAX_WAYS = 64  # cache_loops.c's MAX_WAYS


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled loops (built on first use); :class:`modules.embedding.native_build.NativeError` if no compiler
    can build them."""
    lib = native_build.library(SOURCE)
    for name in ("assign_slots_i32", "assign_slots_i64", "paged_find"):
        getattr(lib, name).restype = ctypes.c_int64
    return lib


def available() -> bool:
    """Whether the C loops can be used here (else, once, a warning: the row cache takes its torch path)."""
    return native_build.available(SOURCE, "the row cache runs its slower torch path")


def assign(ids: torch.Tensor, first: torch.Tensor, nsets: torch.Tensor, set_offset: torch.Tensor, keys: torch.Tensor,
           used: torch.Tensor, uses: torch.Tensor, dirty: torch.Tensor, clock: int, mark_dirty: bool, policy: str,
           floor_hint: str, hold: int) -> tuple[torch.Tensor, ...]:
    """:func:`.set_victims.place` in C (the C file's loop 1), with the same arguments, results and refusal: unique
    ``ids`` (int64, ascending) on the cache's ``keys`` / ``used`` / ``uses`` / ``dirty`` [S, W] (updated in
    place). Returns (slot [n], table [n], the misses' positions in ``ids`` [m], their victims' old keys [m] and
    old dirty flags [m]); a set with too few unpinned ways raises :class:`.set_victims.CacheTooSmallError`
    (``floor_hint`` ends its message), the misses rolled back."""
    n, ways = ids.numel(), keys.shape[1]
    if ways > MAX_WAYS:
        raise ValueError(f"the C loop scores at most {MAX_WAYS} ways a set (got {ways})")
    slot, table, miss, old_key = (torch.empty(n, dtype=torch.int64, device="cpu") for _ in range(4))
    old_dirty = torch.empty(n, dtype=torch.bool, device="cpu")
    old_used, old_uses = torch.empty(n, dtype=torch.int32, device="cpu"), torch.empty(n, dtype=torch.int32, device="cpu")
    count = ctypes.c_int64(0)
    key_type = torch.int32 if keys.dtype == torch.int32 else torch.int64  # (anything else is refused by _ptr)
    fn = library().assign_slots_i32 if key_type == torch.int32 else library().assign_slots_i64
    i64, i32 = torch.int64, torch.int32
    failed = fn(_ptr(ids, i64), ctypes.c_int64(n), _ptr(first, i64), _ptr(nsets, i64), _ptr(set_offset, i64),
                ctypes.c_int64(first.numel()), _ptr(keys, key_type), _ptr(used, i32), _ptr(uses, i32),
                _ptr(dirty, torch.bool), ctypes.c_int64(ways), ctypes.c_int32(clock), ctypes.c_int32(hold),
                ctypes.c_int32(int(mark_dirty)),
                ctypes.c_int32(int(policy == "lfu")), _ptr(slot), _ptr(table), _ptr(miss), _ptr(old_key),
                _ptr(old_dirty), _ptr(old_used), _ptr(old_uses), ctypes.byref(count))
    if failed <= -2:
        raise IndexError(f"row cache: id {int(ids[-2 - failed])} is below the first table's first id "
                         f"{int(first[0])}: ids must be checked before the cache")
    miss = miss[:count.value]
    if failed >= 0:
        in_set = int((slot[miss] // ways == failed).sum())  # a miss's slot is in its set, chosen or not
        pinned = (used[failed] >= hold) & (keys[failed] >= 0)
        raise too_small(in_set, ways, ways - int(pinned.sum()), floor_hint)
    return slot, table, miss, old_key[:miss.numel()], old_dirty[:miss.numel()]


def bloom_add(words: np.ndarray, bits: int, hashes: int, keys: np.ndarray) -> None:
    """Set the filter's bits of ``keys`` (int64) in ``words`` (uint8, ``bits`` bits)."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    library().bloom_add(_ptr(words, np.dtype(np.uint8)), ctypes.c_uint64(bits), ctypes.c_int64(hashes), _ptr(keys),
                        ctypes.c_int64(len(keys)))


def bloom_may_hold(words: np.ndarray, bits: int, hashes: int, keys: np.ndarray) -> np.ndarray:
    """[n] bool: False where the filter surely does not hold the key."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty(len(keys), dtype=bool)
    library().bloom_may_hold(_ptr(words, np.dtype(np.uint8)), ctypes.c_uint64(bits), ctypes.c_int64(hashes), _ptr(keys),
                             ctypes.c_int64(len(keys)), _ptr(out))
    return out


def paged_find(flat: np.ndarray, n_records: int, width: int, per_page: int, page_words: int, fences: np.ndarray,
               keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found [n] bool, the found keys' records [found, width]) of ``keys`` (ascending) in a run's records file
    mapped as ``flat`` (float32, whole pages of ``page_words`` words)."""
    keys, fences = np.ascontiguousarray(keys, dtype=np.int64), np.ascontiguousarray(fences, dtype=np.int64)
    n = len(keys)
    found, out, page = np.empty(n, dtype=bool), np.empty((n, width), dtype=np.float32), np.empty(n, dtype=np.int64)
    hits = library().paged_find(_ptr(flat, np.dtype(np.float32)), ctypes.c_int64(n_records), ctypes.c_int64(width),
                                ctypes.c_int64(per_page), ctypes.c_int64(page_words), _ptr(fences),
                                ctypes.c_int64(len(fences)), _ptr(keys), ctypes.c_int64(n), _ptr(page), _ptr(found),
                                _ptr(out))
    return found, out[:hits]
