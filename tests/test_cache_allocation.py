"""Host memory shared between whole tables and row caches (modules/sharding/cache_allocation.py), against an
exhaustive search over every choice of tier and cache rows, and through place_tables on hand-computed cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from modules.embedding.ssd_tier.backing import ROW_INDEX_BYTES
from modules.sharding.cache_allocation import Claim, allocate, coverage_curve, least_bytes
from modules.sharding.placement import PlacementError, TableInfo, cache_floor, place_tables
from modules.sharding.topology import GB, SsdSpec, TopologySpec


def _cost(c: Claim, r: int | None) -> float:
    return c.host_bytes if r is None else c.cache_cost(r)


def _gain(c: Claim, r: int | None) -> float:
    return c.lookups * (1.0 if r is None else c.share(r))


def _options(c: Claim) -> list[int | None]:
    return ([None] if c.may_host else []) + list(range(min(c.floor, c.rows), c.rows + 1))


def _hull_steps(c: Claim) -> list[float]:
    """Gains of the steps along the upper hull of the table's (bytes, lookups) options from its least one."""
    start = None if c.starts_in_host() else min(c.floor, c.rows)
    points = sorted({(_cost(c, r), _gain(c, r)) for r in _options(c) if _cost(c, r) >= _cost(c, start)})
    hull, here = [], (_cost(c, start), _gain(c, start))
    while True:
        later = [p for p in points if p[0] > here[0] and p[1] > here[1]]
        if not later:
            return hull
        nxt = max(later, key=lambda p: (p[1] - here[1]) / (p[0] - here[0]))
        hull.append(nxt[1] - here[1])
        here = nxt


@st.composite
def claims(draw):
    out = []
    for i in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(1, 7))
        counts = np.sort(np.array(draw(st.lists(st.integers(1, 30), min_size=rows, max_size=rows))))[::-1]
        cum = np.cumsum(counts) / counts.sum()
        curve = ((0, 0.0),) + tuple((r + 1, float(cum[r])) for r in range(rows - 1)) + ((rows, 1.0),)
        row = draw(st.integers(1, 9))
        out.append(Claim(f"t{i}", rows, draw(st.integers(1, 3)), curve, row, row + draw(st.integers(0, 9)),
                         draw(st.integers(0, 4)), draw(st.integers(0, rows)), may_host=draw(st.booleans())))
    return out


@settings(max_examples=300, deadline=None)
@given(claims(), st.floats(0, 1))
def test_allocation_is_within_one_hull_step_of_the_best_choice(cs, where):
    least = least_bytes(cs)
    most = sum(max(_cost(c, r) for r in _options(c)) for c in cs)
    budget = least + where * (most - least)
    chosen = allocate(cs, budget)
    spent = sum(_cost(c, chosen[c.name]) for c in cs)
    assert spent <= budget + 1e-9
    for c in cs:
        assert chosen[c.name] in _options(c)
    best = max(sum(_gain(c, r) for c, r in zip(cs, pick)) for pick in itertools.product(*map(_options, cs))
               if sum(_cost(c, r) for c, r in zip(cs, pick)) <= budget + 1e-9)
    got = sum(_gain(c, chosen[c.name]) for c in cs)
    # the greedy solves the problem with fractional rows but for the one step the budget cuts
    assert got >= best - max((g for c in cs for g in _hull_steps(c)), default=0.0) - 1e-9
    if budget >= sum(min(_cost(c, None if c.may_host else c.rows), _cost(c, c.rows)) for c in cs):
        assert got == sum(c.lookups for c in cs)  # room for every row: every lookup served


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**7), st.dictionaries(st.sampled_from([0.5, 0.8, 0.9, 0.95, 0.99]), st.integers(0, 10**7)))
def test_coverage_curve_rises_from_nothing_to_every_lookup(rows, coverage):
    coverage = dict(zip(sorted(coverage), sorted(coverage.values())))  # more rows carry a larger share
    curve = coverage_curve(rows, coverage)
    assert curve[0] == (0, 0.0) and curve[-1] == (rows, 1.0)
    assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(curve, curve[1:]))
    c = Claim("t", rows, 1, curve, 1, 2, 0, 0)
    for q, r in coverage.items():
        assert c.share(min(rows, max(1, r))) >= q  # the rows the statistics name carry at least their share


def _cpu(ddr_gb: float, tmp_path) -> TopologySpec:
    return TopologySpec(name="cpu", compute_device="cpu", ddr_cap_gb=ddr_gb, ssd=SsdSpec(path=str(tmp_path)))


SLOT, ROW = 68 + 17 + (68 + 8) / 8 + 16, 68  # bytes: a slot and a row with row-wise Adagrad (rows · 4 · (16 + 1))
BIG = TableInfo("big", 1_000_000, 16, {0.5: 1_000, 0.8: 2_000, 0.9: 10_000, 0.95: 100_000, 0.99: 500_000})
FLOOR = 1_024  # MIN_CACHE_ROWS: no batch size given


def _share(t: TableInfo, r: int) -> float:
    return Claim(t.name, t.rows, 1, coverage_curve(t.rows, t.coverage_rows), ROW, SLOT, 0, 0).share(r)


def test_a_table_whose_lookups_few_rows_carry_goes_behind_a_cache_that_holds_them(tmp_path):
    small = TableInfo("small", 100_000, 16, {0.5: 500, 0.8: 2_000, 0.9: 3_000, 0.95: 4_000, 0.99: 5_000})
    budget = 100_000 * ROW + 4_000 * SLOT  # the small table whole and a little more
    placed = place_tables([BIG, small], _cpu(budget / 0.75 / GB, tmp_path), "rowwise_adagrad")
    # the rule before: the small table whole in host memory, the large one's cache what is left
    index = 1_000_000 * ROW_INDEX_BYTES
    served_before = 1 + _share(BIG, int((budget - 100_000 * ROW - index) // SLOT))
    assert placed["big"].tier == placed["small"].tier == "ssd"
    assert placed["small"].cache_rows >= 5_000  # the rows carrying 99 % of its lookups
    spent = sum(p.cache_rows * SLOT + p.rows * ROW_INDEX_BYTES for p in placed.values())
    assert spent <= budget
    served = placed["big"].cache_share + placed["small"].cache_share
    assert abs(served - _share(BIG, placed["big"].cache_rows) - _share(small, placed["small"].cache_rows)) < 1e-12
    assert served > served_before + 0.1, (served, served_before)


def test_a_whole_table_that_fits_is_not_grown_as_slots_instead(tmp_path):
    # every lookup of the uniform table for 13.6 MB in host memory; the large table's rows past 10,000 serve
    # less per byte, those up to it more: the greedy alone takes those first, then cannot afford the move to
    # host memory and grows the small table's cache as slots (1.48 lookups a sample served, not 1.81)
    small = TableInfo("small", 200_000, 16, {q: int(q * 200_000) for q in (0.5, 0.8, 0.9, 0.95, 0.99)})  # uniform
    budget = 200_000 * ROW + 4_000 * SLOT
    placed = place_tables([BIG, small], _cpu(budget / 0.75 / GB, tmp_path), "rowwise_adagrad")
    assert placed["small"].tier == "host" and placed["big"].tier == "ssd"
    assert placed["big"].cache_rows == int((budget - 200_000 * ROW - 1_000_000 * ROW_INDEX_BYTES) // SLOT)
    # with room for both tables whole, both stay in host memory (as before)
    roomy = place_tables([BIG, small], _cpu((1_200_000 * ROW + 1) / 0.75 / GB, tmp_path), "rowwise_adagrad")
    assert {p.tier for p in roomy.values()} == {"host"}


def test_a_table_of_few_distinct_values_needs_a_cache_of_those_not_of_the_batch(tmp_path):
    # a hashed table: 1,460 values over 1M buckets; a batch of 16,384 ids meets at most those rows (× 2 for values
    # new in the evaluation splits, + each feature's missing and OOV rows), so its least cache is 4 × 2 × 1,462
    # rows, not 4 × 16,384; without the distinct count (share 1.0) the floor stays the batch's
    levels = {0.5: 20, 0.8: 200, 0.9: 500, 0.95: 860, 0.99: 1_300}
    hashed, unmeasured = TableInfo("hashed", 1_000_000, 16, {**levels, 1.0: 1_460}), TableInfo("hashed", 1_000_000, 16, levels)
    assert cache_floor(hashed, 16_384) == 4 * 2 * (1_460 + 2) < cache_floor(unmeasured, 16_384) == 4 * 16_384
    assert cache_floor(hashed, 100) == 4 * 100 and cache_floor(hashed, 0) == FLOOR  # the batch binds; no batch
    wide = TableInfo("wide", 10**6, 4, {0.99: 10, 1.0: 12}, features=26)  # each feature's missing and OOV rows
    assert cache_floor(wide, 1_000) == 4 * 2 * (12 + 2 * 26)
    budget = 2_000_000 * ROW_INDEX_BYTES + (4 * 16_384 + cache_floor(hashed, 16_384) + 100) * SLOT
    placed = place_tables([BIG, hashed], _cpu(budget / 0.75 / GB, tmp_path), "rowwise_adagrad", batch_rows=16_384)
    assert placed["hashed"].tier == placed["big"].tier == "ssd"
    assert placed["hashed"].cache_rows >= 4 * 2 * 1_462 and placed["big"].cache_rows >= 4 * 16_384
    with pytest.raises(PlacementError, match="no row cache"):
        place_tables([BIG, unmeasured], _cpu(budget / 0.75 / GB, tmp_path), "rowwise_adagrad", batch_rows=16_384)
