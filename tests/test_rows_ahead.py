"""The row cache's look-ahead (modules/embedding/ssd_tier/rows_ahead.py) against a dict of row values:
whatever the batches, the next batch's rows brought in by the thread never cost a row of the batch under
way its slot (its update — FBGEMM's backward, here an addition — lands on its own row), nor a row another
use of the cache touches in between (the every-row L2's catch-up), and rows a checkpoint wrote back while
they waited are written back again once updated; a result for other ids is not used."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modules.embedding.row_init import RowInit
from modules.embedding.ssd_tier.backing import BackingTable
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache
from modules.embedding.ssd_tier.rows_ahead import RowsAhead

ROWS = 400


def _cache(sets: int, native: bool) -> RowCache:
    table = BackingTable(torch.zeros(ROWS, 1), [], RowInit(0, 0.0, ((0, ROWS, 0),)))  # rows start at 0
    return RowCache([table], [torch.zeros(sets * WAYS, 1)], [[]], "lfu", native=native)


def _add(cache: RowCache, slots: torch.Tensor, value: float) -> None:
    cache.weights[0][cache.local_slots(slots, torch.zeros_like(slots))] += value


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), sets=st.integers(2, 4), native=st.booleans(), steps=st.integers(2, 25),
       guess=st.floats(0.0, 1.0))
def test_rows_brought_ahead_never_take_the_slot_of_a_row_in_use(seed, sets, native, steps, guess):
    rng = np.random.default_rng(seed)
    cache = _cache(sets, native)
    ahead = RowsAhead(cache)
    batches = [torch.from_numpy(np.unique(rng.integers(0, ROWS, int(rng.integers(1, 12 * sets)))))
               for _ in range(steps)]
    value = np.zeros(ROWS)
    for i, ids in enumerate(batches):
        catch_up = torch.from_numpy(np.unique(np.concatenate([rng.choice(ids.numpy(), size=min(2, len(ids))),
                                                              rng.integers(0, ROWS, 2)])))  # others too: a row reset
        slots, _ = ahead.beside(catch_up, dirty=True)  # the every-row L2 before the forward
        _add(cache, slots, 10.0)
        value[catch_up.numpy()] += 10.0
        slots, _, inverse = ahead.batch(ids, dirty=True)  # the forward (ids unique: each its own place)
        assert inverse.equal(torch.arange(len(ids)))
        if i + 1 < steps:  # the next batch — or, now and then, a wrong guess
            ahead.start(batches[i + 1] if rng.random() < guess else torch.from_numpy(
                np.unique(rng.integers(0, ROWS, len(batches[i + 1])))))
        ahead.wait()  # the thread has evicted what it evicts: the backward comes after, at its worst
        _add(cache, slots, 1.0)
        value[ids.numpy()] += 1.0
        if rng.random() < 0.3:  # a checkpoint after the step: every dirty row written back, clean again
            ahead.wait()
            cache.flush()
    ahead.drop()
    cache.flush()
    np.testing.assert_array_equal(cache.tables[0].weights[:, 0].numpy(), value.astype(np.float32))
    assert ahead.taken + ahead.dropped == steps - 1


def test_a_result_is_taken_only_for_the_same_ids_in_training():
    cache = _cache(2, native=True)
    ahead = RowsAhead(cache)
    ahead.start(torch.tensor([1, 5, 9]))
    ahead.batch(torch.tensor([1, 5, 9]), dirty=False)  # an evaluation batch: assigned anew
    ahead.start(torch.tensor([1, 5, 9]))
    ahead.batch(torch.tensor([1, 5, 8]), dirty=True)
    ahead.start(torch.tensor([2, 3]))
    ahead.wait()  # the thread done
    clock = cache.clock
    slots, _, _ = ahead.batch(torch.tensor([2, 3]), dirty=True)
    assert (ahead.taken, ahead.dropped) == (1, 2) and cache.clock == clock  # taken: no call of its own
    assert cache.keys.view(-1)[slots].tolist() == [2, 3]
