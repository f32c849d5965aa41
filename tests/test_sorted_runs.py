"""The row cache's sorted runs (modules/embedding/ssd_tier/sorted_runs.py) against a dict: whatever the sequence of
evictions, seals and background merges, a lookup finds each key's newest record, and the write home
hands over exactly the newest record of every key, once, in ascending key order."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modules.embedding.row_init import RowInit
from modules.embedding.ssd_tier import bloom as bloom_module
from modules.embedding.ssd_tier import sorted_runs
from modules.embedding.ssd_tier.backing import BackingTable
from modules.embedding.ssd_tier.bloom import BloomFilter
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache
from modules.embedding.ssd_tier.sorted_runs import SortedRuns

WIDTH = 3

batches = st.lists(st.sets(st.integers(0, 300), min_size=1, max_size=40), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=batches, capacity=st.integers(1, 60), block=st.integers(1, 50), width=st.sampled_from([3, 200, 1022]),
       native=st.booleans())
def test_lookups_and_the_write_home_give_each_keys_newest_record(tmp_path_factory, monkeypatch, batches, capacity,
                                                                 block, width, native):
    """Filters and lookups in C (native_loops) or in numpy."""
    monkeypatch.setattr(sorted_runs, "BLOCK", block)  # merges and the write home in many blocks
    runs = SortedRuns(tmp_path_factory.mktemp("runs") / "t", width, capacity, native)  # 204, 5 or 1 records a page
    newest: dict[int, np.ndarray] = {}
    for step, keys in enumerate(batches):
        keys = np.array(sorted(keys), dtype=np.int64)
        records = np.zeros((len(keys), width), np.float32)
        records[:, :3] = [[k, step, k * 0.5 + step] for k in keys]
        runs.put(keys, records)
        newest.update(zip(keys.tolist(), records))
        probe = np.arange(0, 320, 7, dtype=np.int64)
        found, got = runs.find(probe)
        assert found.tolist() == [int(k) in newest for k in probe]
        np.testing.assert_array_equal(got, np.stack([newest[int(k)] for k in probe[found]]) if found.any()
                                      else np.zeros((0, width), np.float32))
    home: list[tuple[np.ndarray, np.ndarray]] = []
    runs.write_home(lambda k, r: home.append((k.copy(), r.copy())))
    keys = np.concatenate([k for k, _ in home])
    assert keys.tolist() == sorted(newest)  # each key once, ascending
    np.testing.assert_array_equal(np.concatenate([r for _, r in home]), np.stack([newest[k] for k in sorted(newest)]))
    assert not runs.runs and not runs.memtable and not list(runs.stem.parent.glob("t.run*"))  # emptied, files gone


def test_runs_of_a_tier_are_merged_into_the_next(tmp_path):
    fan_in = sorted_runs.FAN_IN
    seals = fan_in * fan_in  # F seals of 10 keys: F merges into tier 1, then one into tier 2
    runs = SortedRuns(tmp_path / "t", WIDTH, 10)
    for step in range(seals):
        keys = np.arange(step * 5, step * 5 + 10, dtype=np.int64)  # half of each overlaps the one before
        runs.put(keys, np.full((10, WIDTH), step, np.float32))
        runs.wait()
    assert [r.tier for r in runs.runs] == [2]
    assert len(runs.runs[0].keys) == (seals - 1) * 5 + 10  # duplicates dropped
    found, got = runs.find(np.array([0, 7, (seals - 1) * 5 + 9], dtype=np.int64))
    assert found.all() and got[:, 0].tolist() == [0, 1, seals - 1]  # the newest wins
    assert len(list(tmp_path.glob("t.run*"))) == 2  # the merged runs' files were deleted


def test_rows_evicted_again_while_a_merge_runs_keep_their_newest_record(tmp_path, monkeypatch):
    """A merge in the background must not hide a newer run's records of the same keys."""
    held, release = threading.Event(), threading.Event()
    blocks = sorted_runs.merged_blocks

    def slow_merge(sources):
        held.set()
        release.wait(30)
        yield from blocks(sources)

    monkeypatch.setattr(sorted_runs, "merged_blocks", slow_merge)
    runs = SortedRuns(tmp_path / "t", WIDTH, 4)
    keys = np.arange(4, dtype=np.int64)
    for step in range(sorted_runs.FAN_IN):  # a tier's worth of seals of keys 0-3: a merge starts, and waits
        runs.put(keys, np.full((4, WIDTH), step, np.float32))
    assert held.wait(30)
    runs.put(keys, np.full((4, WIDTH), 9, np.float32))  # sealed while the merge runs: newer than its output
    release.set()
    runs.wait()
    assert [r.tier for r in runs.runs] == [0, 1]
    found, got = runs.find(keys)
    assert found.all() and got[:, 0].tolist() == [9, 9, 9, 9]


def test_bloom_filter_has_no_false_negatives_and_about_its_stated_false_positives():
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 1 << 40, 20_000))
    bloom = BloomFilter(keys)
    assert bloom.may_hold(keys).all()
    rate = bloom.may_hold(rng.integers(1 << 41, 1 << 42, 50_000)).mean()
    k, b = bloom_module.HASHES, bloom_module.BITS_PER_KEY
    assert 0.3 * (1 - math.exp(-k / b)) ** k < rate < 2 * (1 - math.exp(-k / b)) ** k  # 2.4 % at b = 8, k = 4


def test_a_row_cache_whose_runs_outgrow_their_bound_writes_them_home_and_keeps_every_update(tmp_path):
    """Many more distinct rows than slots, updated at random: evicted to the runs, read back, written home when
    the runs pass RUN_RECORDS_PER_SLOT records a slot; after a flush the table holds each row's last value."""
    rows, slots = 5_000, 2 * WAYS
    table = BackingTable(torch.zeros(rows, 2), [], RowInit(0, 0.0, ((0, rows, 0),)))
    cache = RowCache([table], [torch.zeros(slots, 2)], [[]], "lru", runs=tmp_path / "t")
    last = np.zeros((rows, 2), np.float32)
    rng = np.random.default_rng(1)
    sweeps = 0
    for step in range(1, 400):
        ids = torch.from_numpy(np.unique(rng.integers(0, rows, 20)))
        slot, tab = cache.assign(ids, dirty=True)
        local = cache.local_slots(slot, tab)
        np.testing.assert_array_equal(cache.weights[0][local].numpy(), last[ids.numpy()])  # read back exactly
        cache.weights[0][local] += torch.tensor([1.0, float(step)])  # the kernel's update
        last[ids.numpy()] += [1.0, step]
        sweeps += cache.runs.records == 0 and step > 1
    assert sweeps > 0  # the bound was reached and the runs went home
    cache.flush()
    np.testing.assert_array_equal(table.weights.numpy(), last)


def test_rows_overwritten_whole_are_not_read_and_outlive_their_older_records(tmp_path):
    """Rows that start afresh (a ZCH row changing hands) get slots without a read (``load=False``): among many
    more distinct rows than slots, some steps update rows, others overwrite rows whole — rows whose older
    records sit in the runs, in the file or nowhere. Every later read gives the newest value, the overwrites
    read no row, and after a flush the table holds each row's last value (the reference: a plain array)."""
    rows, slots = 3_000, 2 * WAYS
    table = BackingTable(torch.zeros(rows, 2), [torch.zeros(rows)], RowInit(0, 0.0, ((0, rows, 0),)))
    cache = RowCache([table], [torch.zeros(slots, 2)], [[torch.zeros(slots)]], "lfu", runs=tmp_path / "t")
    last, state = np.zeros((rows, 2), np.float32), np.zeros(rows, np.float32)
    rng = np.random.default_rng(3)
    overwritten_missing = 0
    for step in range(1, 300):
        ids = torch.from_numpy(np.unique(rng.integers(0, rows, 20)))
        if step % 3 == 0:
            read_before, cached = cache.stats.rows_read, cache.keys.view(-1)[cache.keys.view(-1) >= 0].long()
            overwritten_missing += int((~torch.isin(ids, cached)).sum())
            slot, tab = cache.assign(ids, dirty=True, load=False)
            local = cache.local_slots(slot, tab)
            cache.weights[0][local] = torch.tensor([-float(step), 0.5])  # the row as it starts afresh
            cache.states[0][0][local] = 0.0
            last[ids.numpy()], state[ids.numpy()] = [-step, 0.5], 0.0
            assert cache.stats.rows_read == read_before  # nothing read for rows about to be overwritten
            continue
        slot, tab = cache.assign(ids, dirty=True)
        local = cache.local_slots(slot, tab)
        np.testing.assert_array_equal(cache.weights[0][local].numpy(), last[ids.numpy()])
        np.testing.assert_array_equal(cache.states[0][0][local].numpy(), state[ids.numpy()])
        cache.weights[0][local] += torch.tensor([1.0, float(step)])
        cache.states[0][0][local] += 1.0
        last[ids.numpy()] += [1.0, step]
        state[ids.numpy()] += 1.0
    assert overwritten_missing > 500 and cache.stats.rows_read > 0  # both paths ran, past older records
    cache.flush()
    np.testing.assert_array_equal(table.weights.numpy(), last)
    np.testing.assert_array_equal(table.states[0].numpy(), state)
    with pytest.raises(ValueError, match="dirty=True"):
        cache.assign(torch.tensor([1]), dirty=False, load=False)
