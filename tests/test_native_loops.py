"""The row cache's C loops (modules/embedding/ssd_tier/cache_loops.c via native_loops.py) against their torch and
numpy twins:

* slot assignment against set_victims.place (with set_victims.choose_ways, itself tested against a per-set
  reference in test_set_victims.py): on random caches — keys, last uses, use counts, dirty flags, several
  tables of different set counts — the same slots, tables, misses, victims' old keys and dirty flags, the
  same cache state after, and the same refusal (and state) where a set has too few unpinned ways;
* a sorted run's Bloom filter: the same bits, the same answers, no false negatives;
* a sorted run's records file: the same keys found and records read as numpy, and as the keys written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modules.embedding.row_init import RowInit
from modules.embedding.ssd_tier import native_loops
from modules.embedding.ssd_tier.backing import BackingTable
from modules.embedding.ssd_tier.bloom import BloomFilter
from modules.embedding.ssd_tier.paged_records import PagedRecords, mapped, paged, per_page
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache
from modules.embedding.ssd_tier.set_victims import USE_CAP, CacheTooSmallError, place


def test_the_c_loop_builds_here():
    assert native_loops.available(), "gcc is on every machine of this project (README); the C loop must build"


def _cache(rows: list[int], sets: list[int], key_dtype: torch.dtype) -> RowCache:
    tables = [BackingTable(torch.zeros(n, 1), [], RowInit(0, 0.0, ((0, n, t),))) for t, n in enumerate(rows)]
    cache = RowCache(tables, [torch.zeros(s * WAYS, 1) for s in sets], [[] for _ in sets], "lfu", native=False)
    cache.keys = cache.keys.to(key_dtype)
    return cache


STATE = ("keys", "used", "uses", "dirty")


@settings(max_examples=120, deadline=None)
@given(data=st.data(), tables=st.integers(1, 3), policy=st.sampled_from(["lru", "lfu"]),
       key_dtype=st.sampled_from([torch.int32, torch.int64]), mark_dirty=st.booleans())
def test_the_c_loop_places_every_id_as_the_torch_path_does(data, tables, policy, key_dtype, mark_dirty):
    rows = [data.draw(st.integers(40, 400)) for _ in range(tables)]
    sets = [data.draw(st.integers(1, 3)) for _ in range(tables)]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    clock = int(rng.integers(2, 6))
    hold = clock - int(rng.integers(0, 3))  # < clock: the rows of calls since `hold` stay (a batch under way)
    caches = [_cache(rows, sets, key_dtype) for _ in range(2)]
    first = np.cumsum([0, *rows[:-1]])
    shape = caches[0].keys.shape
    # a cache in mid-run: each set holds distinct rows of its own table (or nothing); counts and flags at random
    keys = np.full(shape, -1, dtype=np.int64)
    for t in range(tables):
        for s in range(sets[t]):
            mine = np.arange(s, rows[t], sets[t])  # the rows whose set is s
            held = rng.choice(mine, size=min(WAYS, len(mine)), replace=False)
            held[rng.random(len(held)) < 0.2] = -1  # some ways empty
            keys[int(caches[0].set_offset[t]) + s, :len(held)] = np.where(held >= 0, held + first[t], -1)
    used = rng.integers(0, clock, shape)  # the clock ticks to `clock` in assign: nothing pinned yet
    uses, dirty = rng.integers(0, 4, shape), rng.random(shape) < 0.5
    for cache in caches:
        cache.policy, cache.clock = policy, clock - 1
        cache.keys[:] = torch.from_numpy(keys)
        cache.used[:], cache.uses[:], cache.dirty[:] = torch.from_numpy(used), torch.from_numpy(uses), torch.from_numpy(dirty)
    ids = torch.from_numpy(np.unique(rng.integers(0, sum(rows), int(rng.integers(1, 4 * WAYS * sum(sets))))))

    def run(cache: RowCache, native: bool):
        cache.clock += 1
        loop = native_loops.assign if native else place
        return loop(ids, cache.first, cache.nsets, cache.set_offset, cache.keys, cache.used, cache.uses, cache.dirty,
                    cache.clock, mark_dirty, policy, "raise", hold=hold)

    results = []
    for cache, native in zip(caches, (False, True)):
        try:
            results.append(run(cache, native))
        except CacheTooSmallError:
            results.append(None)
    assert (results[0] is None) == (results[1] is None)
    if results[0] is not None:
        for a, b in zip(*results):
            assert torch.equal(a, b)
    for name in STATE:  # after a refusal too: the hits counted, no miss admitted
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), name


@pytest.mark.parametrize("native", [False, True])
def test_a_set_with_too_few_free_ways_is_refused_with_the_same_message(native):
    table = BackingTable(torch.zeros(10 * WAYS, 1), [], RowInit(0, 0.0, ((0, 10 * WAYS, 0),)))
    cache = RowCache([table], [torch.zeros(WAYS, 1)], [[]], "lfu", native=native)  # one set
    with pytest.raises(CacheTooSmallError, match=rf"{WAYS + 1} rows of one batch fall into one set of {WAYS} ways "
                                                 rf"\({WAYS} free\).*raise topology.ssd.cache_mb"):
        cache.assign(torch.arange(WAYS + 1), dirty=True)


@pytest.mark.parametrize("native", [False, True])
def test_lfu_use_counts_saturate_so_the_hottest_row_stays(native):
    """A row with 2^23 − 1 uses met again keeps the highest score (uses << 40 overflowed int64 at 2^23, so the
    hottest row scored lowest and was evicted first); the victim is the least-used way, the lowest of ties."""
    cache = _cache([4 * WAYS], [1], torch.int64)  # one set: every row of the table falls into it
    cache.keys[0] = torch.arange(WAYS)
    cache.used[0], cache.uses[0] = 1, 5
    cache.uses[0, 0] = USE_CAP
    loop = native_loops.assign if native else place

    def call(ids: list[int], clock: int):
        return loop(torch.tensor(ids), cache.first, cache.nsets, cache.set_offset, cache.keys, cache.used, cache.uses,
                    cache.dirty, clock, False, "lfu", "raise", hold=clock)

    call([0], clock=2)  # the hot row met once more
    assert int(cache.uses[0, 0]) == USE_CAP
    _, _, miss, old_key, _ = call([2 * WAYS], clock=3)  # a new row needs a way
    assert miss.tolist() == [0] and old_key.tolist() == [1]
    assert 0 in cache.keys[0].tolist()


@pytest.mark.parametrize("native", [False, True])
def test_an_id_below_the_first_table_is_refused_before_any_slot_is_touched(native):
    cache = _cache([2 * WAYS], [2], torch.int64)
    before = {name: getattr(cache, name).clone() for name in STATE}
    loop = native_loops.assign if native else place
    with pytest.raises(IndexError, match="id -3 is below the first table's first id 0"):
        loop(torch.tensor([-3, 1]), cache.first, cache.nsets, cache.set_offset, cache.keys, cache.used, cache.uses,
             cache.dirty, 2, True, "lfu", "raise", hold=2)
    assert all(torch.equal(before[name], getattr(cache, name)) for name in STATE)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 3000))
def test_the_c_bloom_filter_sets_and_answers_as_the_numpy_one(seed, n):
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 2**40, n))
    c, ref = BloomFilter(keys, native=True), BloomFilter(keys, native=False)
    assert np.array_equal(c.words, ref.words)
    asked = np.concatenate([keys, rng.integers(0, 2**40, 2000)])
    held = c.may_hold(asked)
    assert np.array_equal(held, ref.may_hold(asked)) and held[:len(keys)].all()  # no false negatives


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 700), width=st.sampled_from([1, 5, 17]))
def test_the_c_lookup_of_a_runs_records_finds_what_the_numpy_one_finds(tmp_path_factory, seed, n, width):
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(10, 5000, n))
    records = rng.standard_normal((len(keys), width)).astype(np.float32)
    path = tmp_path_factory.mktemp("run") / "records"
    path.write_bytes(paged(keys, records, width).tobytes())
    fences = keys[::per_page(width)]
    asked = np.unique(np.concatenate([rng.choice(keys, min(len(keys), 50)), rng.integers(0, 5100, 50)]))
    got = [PagedRecords(mapped(path, at_random=True), len(keys), width, native=native).find(asked, fences)
           for native in (True, False)]
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
    expect = np.isin(asked, keys)
    assert np.array_equal(got[0][0], expect)  # and against the keys themselves
    assert np.array_equal(got[0][1], records[np.searchsorted(keys, asked[expect])])


@pytest.mark.parametrize("native", [False, True])
def test_ids_in_any_order_and_repeated_get_the_slots_of_their_sorted_unique_ids(native):
    """A batch's ids arrive sorted and unique; rows an optimizer term updates may not: same slots either way."""
    rows = [500, 700]
    rng = np.random.default_rng(0)
    caches = []
    for _ in range(2):
        tables = [BackingTable(torch.zeros(n, 1), [], RowInit(0, 0.0, ((0, n, t),))) for t, n in enumerate(rows)]
        caches.append(RowCache(tables, [torch.zeros(4 * WAYS, 1) for _ in rows], [[] for _ in rows], "lru", native=native))
    for _ in range(20):
        ids = torch.from_numpy(rng.integers(0, sum(rows), 90))
        unique, inverse = torch.unique(ids, return_inverse=True)
        slot, table = caches[0].assign(ids, dirty=True)
        ref_slot, ref_table = caches[1].assign(unique, dirty=True)
        assert torch.equal(slot, ref_slot[inverse]) and torch.equal(table, ref_table[inverse])
        assert torch.equal(table, (ids >= rows[0]).long())
    assert torch.equal(caches[0].keys, caches[1].keys) and (caches[0].keys >= 0).sum() > 100
