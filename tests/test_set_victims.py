"""The row cache's eviction policy (modules/embedding/ssd_tier/set_victims.py) against a per-set reference
written from its formula, with the sets scored a few at a time; and a row cache looked up and admitted in
many small chunks against the same cache in one chunk (modules/embedding/ssd_tier/row_cache.py)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modules.embedding.row_init import RowInit
from modules.embedding.ssd_tier import row_cache, set_victims
from modules.embedding.ssd_tier.backing import BackingTable
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache
from modules.embedding.ssd_tier.set_victims import CacheTooSmallError, choose_ways


def _reference(sets: list[int], keys: np.ndarray, used: np.ndarray, uses: np.ndarray, clock: int,
               policy: str) -> list[int]:
    """Set by set: score each way (empty −1, pinned +∞, lru last use, lfu (uses, last use)), stable sort, the
    k-th miss of the set takes rank k."""
    out, seen = [], {}
    for s in sets:
        def score(w: int) -> tuple:
            if keys[s, w] < 0:
                return (-1, 0)
            if used[s, w] == clock:
                return (float("inf"), 0)
            return (0, used[s, w]) if policy == "lru" else (uses[s, w], used[s, w])
        ranked = sorted(range(keys.shape[1]), key=score)  # sorted() is stable
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.append(s * keys.shape[1] + ranked[k])
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data(), nsets=st.integers(1, 9), ways=st.sampled_from([2, 4]), chunk=st.integers(1, 4),
       policy=st.sampled_from(["lru", "lfu"]))
def test_each_miss_takes_the_way_its_set_ranks_next_whatever_the_chunks(data, nsets, ways, chunk, policy):
    clock = 5
    draw = lambda lo, hi: np.array(data.draw(st.lists(st.integers(lo, hi), min_size=nsets * ways,  # noqa: E731
                                                          max_size=nsets * ways))).reshape(nsets, ways)
    keys, used, uses = draw(-1, 3), np.minimum(draw(0, clock + 3), clock), draw(0, 3)  # used: often this call (pinned)
    free = [int(((used[s] != clock) | (keys[s] < 0)).sum()) for s in range(nsets)]  # an empty way is free
    sets = sorted(data.draw(st.lists(st.integers(0, nsets - 1), max_size=3 * nsets)))
    args = [torch.tensor(sets, dtype=torch.int64), torch.from_numpy(keys), torch.from_numpy(used).int(),
            torch.from_numpy(uses).int(), clock, policy, "raise the cache"]
    with mock.patch.object(set_victims, "SETS_PER_CHUNK", chunk):
        if any(sets.count(s) > free[s] for s in set(sets)):
            with pytest.raises(CacheTooSmallError, match="raise the cache"):
                choose_ways(*args)
            return
        got = choose_ways(*args)
    assert got.tolist() == _reference(sets, keys, used, uses, clock, policy)


def test_a_cache_looked_up_in_small_chunks_or_with_64_bit_keys_assigns_and_trains_as_in_one():
    """The same id stream through caches on the torch path — looked up and admitted in chunks of 7 ids and 2
    sets, or in a single chunk — and on the C loop (native_loops), with int32 keys and with 64-bit keys (as a
    tier of 2^31 rows or more has); every step's slots and the rows at the end are the same."""
    rows, slots = 3_000, 8 * WAYS
    rng = np.random.default_rng(3)
    stream = [torch.from_numpy(np.unique(rng.integers(0, rows, 60))) for _ in range(80)]

    def run(native: bool = False) -> tuple[list[torch.Tensor], torch.Tensor, torch.dtype]:
        table = BackingTable(torch.zeros(rows, 2), [], RowInit(0, 0.1, ((0, rows, 0),)))
        cache = RowCache([table], [torch.zeros(slots, 2)], [[]], "lfu", native=native)
        seen = []
        for step, ids in enumerate(stream):
            slot, tab = cache.assign(ids, dirty=True)
            cache.weights[0][cache.local_slots(slot, tab)] += float(step)
            seen.append(slot)
        cache.flush()
        return seen, table.weights.clone(), cache.keys.dtype

    whole = run()
    with mock.patch.object(set_victims, "LOOKUP_CHUNK", 7), mock.patch.object(set_victims, "SETS_PER_CHUNK", 2):
        chunked = run()
    native = run(native=True)
    with mock.patch.object(row_cache, "INT32_KEY_ROWS", rows):
        wide_keys, native_wide_keys = run(), run(native=True)
    assert (whole[2], wide_keys[2], native_wide_keys[2]) == (torch.int32, torch.int64, torch.int64)
    for other in (chunked, native, wide_keys, native_wide_keys):
        assert all(torch.equal(a, b) for a, b in zip(whole[0], other[0]))
        assert torch.equal(whole[1], other[1]) and whole[1].abs().sum() > 0
