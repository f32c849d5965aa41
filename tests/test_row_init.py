"""Initial rows drawn from (seed, table, row) (modules/embedding/row_init.py): the C draws (row_init.c) against their
numpy twin bit for bit, straight into scattered rows as into a fresh array, and both against an independent
float64 reference (test_row_cache.py checks one value against SplitMix64 in Python integers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modules.embedding import row_init
from modules.embedding.row_init import RowInit, normal_rows, normal_rows_numpy


def test_the_c_draws_build_here():
    assert row_init.native(), "gcc is on every machine of this project (README); row_init.c must build"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), key=st.integers(0, 2**32 - 1),
       rows=st.lists(st.integers(0, 2**40), min_size=1, max_size=300), dim=st.integers(1, 130),
       std=st.sampled_from([1.0, 0.05, 3.7e-3]))
def test_c_and_numpy_draw_the_same_bits(seed, key, rows, dim, std):
    r = np.array(rows, dtype=np.int64)
    c = normal_rows(seed, key, r, dim, std).numpy()
    ref = normal_rows_numpy(seed, key, r.astype(np.uint64), dim, std)
    assert c.dtype == ref.dtype == np.float32
    assert np.array_equal(c.view(np.uint32), ref.view(np.uint32))


def test_the_draws_follow_box_muller_in_float64_to_float32_precision():
    rows = np.arange(0, 2_000_000, 37)
    got = normal_rows(9, 1234, rows, 16, 1.0).numpy().astype(np.float64)
    x = row_init._mix(row_init._base(9, 1234) + (rows.astype(np.uint64)[:, None] * np.uint64(16)
                                                  + np.arange(1, 17, dtype=np.uint64)[None]) * row_init.GAMMA)
    # u as the formula rounds it to float32 (x≫40 + ½ needs 25 bits), then everything else in float64
    u1 = (((x >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)).astype(np.float64)
    u2 = (((x & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)).astype(np.float64)
    ref = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
    assert np.abs(got - ref).max() < 2e-6  # |w| ≤ 5.9: a few float32 ulps
    assert abs(got.mean()) < 0.01 and abs(got.std() - 1) < 0.01
    assert abs(np.mean(got**4) - 3) < 0.05  # normal kurtosis


@pytest.mark.parametrize("native", [True, False])
def test_scattered_draws_equal_the_rows_drawn_whole_for_stacked_and_sharded_tables(native, monkeypatch):
    monkeypatch.setattr(row_init, "native", lambda: native)
    init = RowInit.of_tables(4, 0.1, ["a", "b", "c"], [50, 7, 300])
    whole = init(torch.empty(357, 12))
    rows = torch.tensor([356, 3, 50, 56, 57, 0, 120])
    slots = torch.tensor([9, 0, 4, 2, 7, 5, 1])
    dst = torch.full((10, 5), -1.0)
    init.draw_into(dst, slots, rows, 12, 6)  # columns 6…10 of the 12-wide table: a column shard
    assert torch.equal(dst[slots], whole[rows][:, 6:11])
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[slots] = False
    assert bool((dst[untouched] == -1).all())
    zeros = RowInit.of_tables(4, 0.0, ["w"], [30])
    dst = torch.ones(4, 3)
    zeros.draw_into(dst, torch.tensor([1, 3]), torch.tensor([5, 29]), 3, 0)
    assert dst.sum().item() == 6.0 and dst[1].abs().sum().item() == 0 == dst[3].abs().sum().item()


def test_rows_not_in_host_float32_are_the_float32_draws_rounded_block_by_block(monkeypatch):
    """fp16 rows (model.table_precision) take the path device memory takes: drawn in float32 blocks on the host, then
    copied in dst's type. With blocks of 3 rows, scattered destination rows of a column shard are still each the
    float32 draw rounded to fp16, and the other rows untouched."""
    monkeypatch.setattr(row_init, "DRAW_BLOCK_VALUES", 15)  # 3 rows of 5 columns a block
    init = RowInit.of_tables(4, 0.1, ["a", "b", "c"], [50, 7, 300])
    whole = init(torch.empty(357, 12))
    rows = torch.tensor([356, 3, 50, 56, 57, 0, 120])
    slots = torch.tensor([9, 0, 4, 2, 7, 5, 1])
    dst = torch.full((10, 5), -1.0, dtype=torch.float16)
    init.draw_into(dst, slots, rows, 12, 6)
    assert torch.equal(dst[slots], whole[rows][:, 6:11].half())
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[slots] = False
    assert bool((dst[untouched] == -1).all())
    assert torch.equal(init(torch.empty(357, 12, dtype=torch.float16)), whole.half())  # whole, in 119 blocks


def test_a_table_on_the_meta_device_is_left_alone():
    init = RowInit.of_tables(4, 0.1, ["a", "b"], [5, 6])
    assert init(torch.empty(11, 4, device="meta")).device.type == "meta"  # no draw, no crash
