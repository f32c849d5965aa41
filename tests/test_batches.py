"""Batch construction: KJT layout, per-rank slices, evaluation coverage, epoch shuffling."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.batches import BatchLoader, make_batch
from pipeline.data.store import SplitArrays

KEYS = ["C1", "C2", "C3"]


@pytest.fixture()
def arrays() -> SplitArrays:
    rng = np.random.default_rng(0)
    n = 1000
    return SplitArrays(rng.integers(0, 2, n).astype(np.int8), rng.normal(size=(n, 4)).astype(np.float32),
                       rng.integers(0, 50, size=(n, 3)).astype(np.int32))


def test_kjt_layout_matches_store_columns(arrays):
    rows = np.array([5, 17, 3, 999])
    b = make_batch(arrays, rows, KEYS)
    kjt = b.sparse_features
    assert kjt.keys() == KEYS and kjt.stride() == 4
    assert kjt.lengths().tolist() == [1] * 12
    for f, key in enumerate(KEYS):
        assert kjt[key].values().tolist() == arrays.sparse[rows, f].tolist()
    np.testing.assert_array_equal(b.dense_features.numpy(), arrays.dense[rows])
    np.testing.assert_array_equal(b.labels.numpy(), arrays.label[rows].astype(np.float32))


def test_rank_slices_make_up_the_single_rank_global_batch(arrays):
    one = BatchLoader(arrays, KEYS, 128, rank=0, world_size=1, train=True, seed=3)
    two = [BatchLoader(arrays, KEYS, 128, rank=r, world_size=2, train=True, seed=3) for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) == 1000 // 128
    for i, (g, b0, b1) in enumerate(zip(one, *two)):
        assert b0.labels.shape[0] == b1.labels.shape[0] == 64
        whole = sorted(g.sparse_features.values().view(3, -1).T.tolist())
        parts = sorted(b0.sparse_features.values().view(3, -1).T.tolist() + b1.sparse_features.values().view(3, -1).T.tolist())
        assert whole == parts, i


def test_evaluation_covers_every_row_once_with_equal_steps_per_rank(arrays):
    loaders = [BatchLoader(arrays, KEYS, 96, rank=r, world_size=2, train=False) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == -(-1000 // 96)
    seen = []
    for loader in loaders:
        order = loader._global_order()
        for i in range(len(loader)):
            rows, valid = loader.local_rows(i, order)
            assert len(rows) == 48
            seen.extend(rows[:valid].tolist())
    assert sorted(seen) == list(range(1000))
    last = list(loaders[1])[-1]
    assert last.valid_rows == max(0, 1000 - (len(loaders[1]) - 1) * 96 - 48)


def test_epochs_reshuffle_deterministically(arrays):
    loader = BatchLoader(arrays, KEYS, 100, rank=0, world_size=1, train=True, seed=1)
    first = [b.labels.clone() for b in loader]
    again = [b.labels.clone() for b in loader]
    loader.sampler.set_epoch(1)
    other = [b.sparse_features.values().clone() for b in loader]
    loader.sampler.set_epoch(0)
    assert all((a == b).all() for a, b in zip(first, again))
    assert not all((a == b).all() for a, b in zip([b.sparse_features.values() for b in loader], other))


def test_peek_hands_the_iteration_the_same_batch_and_changes_no_order(arrays):
    """The row caches look a batch ahead (pipeline/training/callbacks/next_batch_rows.py): the batch peeked
    is the object the iteration yields, the epoch's order is the one without peeking, past the end is None."""
    plain = [b.sparse_features.values().clone() for b in BatchLoader(arrays, KEYS, 100, 0, 1, train=True, seed=4)]
    loader = BatchLoader(arrays, KEYS, 100, rank=0, world_size=1, train=True, seed=4)
    it = iter(loader)
    for i in range(len(loader)):
        ahead = loader.peek(i + 1) if i % 3 else None  # the look-ahead does not run every step
        batch = next(it)
        assert batch.sparse_features.values().equal(plain[i])
        if i:
            assert loader.peek(i) is batch  # made once
        if ahead is not None:
            assert loader.peek(i + 1) is ahead
    assert loader.peek(len(loader)) is None and len(loader._made) <= 3  # only the last few are kept


def test_ring_batches_built_ahead_in_a_thread_equal_the_plain_ones_in_five_reused_buffers(arrays):
    """For a GPU: each training batch gathered straight into one of 5 reused (page-locked there) buffers by the
    loader's thread, two ahead; the same rows, in the same order, as the plain loader's, also for a resumed epoch.
    A batch leaves its slot when moved (a copy; on the CPU a clone), and only then is the slot refilled."""
    import torch

    from pipeline.data.batch_ring import SLOTS

    for resume in (None, 3):
        plain = BatchLoader(arrays, KEYS, 64, rank=1, world_size=2, train=True, seed=5)
        ring = BatchLoader(arrays, KEYS, 64, rank=1, world_size=2, train=True, seed=5, background=True)
        for loader in (plain, ring):
            loader.sampler.set_epoch(2)
            if resume:
                loader.resume_at(2, resume)
        buffers, n = set(), 0
        for want, got in zip(plain, ring):  # (held, not moved, 5 batches would use up the ring)
            n += 1
            buffers.add(got.sparse_features.values().data_ptr())
            moved = got.to(torch.device("cpu"))
            assert got.slot is None and moved.sparse_features.values().data_ptr() not in buffers
            assert torch.equal(moved.sparse_features.values(), want.sparse_features.values())
            assert torch.equal(moved.sparse_features.lengths(), want.sparse_features.lengths())
            assert moved.sparse_features.offset_per_key() == want.sparse_features.offset_per_key()
            assert torch.equal(moved.dense_features, want.dense_features)
            assert torch.equal(moved.labels, want.labels)
        assert n == 1000 // 64 - (resume or 0) and len(buffers) <= SLOTS


def test_one_hot_batches_share_one_lengths_tensor(arrays):
    """The lengths of a one-hot batch are all 1: made once per size, not per batch (nor copied to the device per
    batch: pipeline/data/batch_ring.constant_lengths)."""
    first, second = (make_batch(arrays, np.arange(s, s + 8), KEYS) for s in (0, 8))
    assert first.sparse_features.lengths() is second.sparse_features.lengths()


def test_an_epoch_left_early_stops_the_ring_builder(arrays):
    """Batches taken but never moved hold their slots; leaving the epoch must not wait for them."""
    import threading
    import time

    loader = BatchLoader(arrays, KEYS, 64, rank=0, world_size=1, train=True, background=True)
    it = iter(loader)
    held = [next(it) for _ in range(4)]  # the builder now waits for a free slot
    time.sleep(0.3)
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 5 and len(held) == 4
    assert not any(t.name == "prefetch" and t.is_alive() for t in threading.enumerate())
