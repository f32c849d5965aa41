"""Raw 64-bit ids and zero-collision tables (model.zch): the mapping against independent references
(an LRU bookkeeping of our own, the TTL rule), the raw store, and a killed run resumed exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import JaggedTensor, KeyedJaggedTensor

from modules.embedding.zch.config import FIRST_ROW, MISSING_ROW, ZchConfig
from modules.embedding.zch.mapping import load_mapping_state, lookup_rows, mapping_state
from modules.embedding.zch.remapper import ZchRemapper
from pipeline.checkpoint.discovery import complete_checkpoints
from tests.test_checkpointing import _assert_same, _kill, _run, _run_id_of, _tensors


def _kjt(values: dict[str, list[int]]) -> KeyedJaggedTensor:
    keys = list(values)
    flat = torch.tensor([v for k in keys for v in values[k]], dtype=torch.int64)
    return KeyedJaggedTensor(keys=keys, values=flat, lengths=torch.ones(len(flat), dtype=torch.int32),
                             stride=len(values[keys[0]]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=30),
       st.integers(3, 12))
def test_lru_rows_hold_the_most_recent_ids_without_collisions(steps, rows):
    """After every admission round (interval 1): no two held ids share a row, rows lie in [2, rows], the held ids
    are the most recently seen (no held id older than an id turned away: an LRU bookkeeping of our own, in rounds),
    missing values (id 0) read row 1 and an id never seen the unknown row."""
    cfg = ZchConfig(rows=rows, eviction_interval=1)
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    remapper.train()
    last: dict[int, int] = {}
    for r, ids in enumerate(steps):
        out = remapper(_kjt({"a": ids})).values().tolist()
        for i in ids:
            if i:
                last[i] = r
        row_of = {i: o for i, o in zip(ids, out)}
        assert all(row_of[i] == MISSING_ROW for i in ids if i == 0)
        held = {i: o for i, o in row_of.items() if i and o != rows + 1}
        assert len(set(held.values())) == len(held) and all(FIRST_ROW <= o <= rows for o in held.values())
        remapper.eval()
        seen = remapper(_kjt({"a": sorted(last)})).values().tolist()
        remapper.train()
        holding = {i for i, o in zip(sorted(last), seen) if o != rows + 1}
        assert len(holding) == min(len(last), rows - 1)  # one row is the unknown ids'
        if len(holding) < len(last):
            assert min(last[i] for i in holding) >= max(last[i] for i in last if i not in holding)
    remapper.eval()
    assert remapper(_kjt({"a": [1_000_000]})).values().tolist() == [rows + 1]
    # training's remap and serving's read-only one (numpy, the model folder's mapping) equal TorchRec's own
    probe = [0, 1_000_000, *sorted(last)]
    ids = torch.tensor(probe)
    library = remapper.mch["t"].remap({"t": JaggedTensor(values=ids, lengths=torch.ones_like(ids))})["t"].values()
    expected = torch.where(ids == 0, MISSING_ROW, library).tolist()
    assert remapper(_kjt({"a": probe})).values().tolist() == expected
    assert lookup_rows(mapping_state(remapper), "t", np.array(probe)).tolist() == expected


def test_ttl_keeps_a_row_for_ttl_days_of_data_then_gives_it_to_a_new_id():
    cfg = ZchConfig(rows=3, eviction="ttl", ttl_days=2, eviction_interval=1)  # two rows for ids
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    remapper.train()

    def rows_on(day: int, ids: list[int]) -> list[int]:
        remapper.set_day(day)
        return remapper(_kjt({"a": ids})).values().tolist()

    first = rows_on(0, [10, 11])
    assert sorted(first) == [2, 3]
    assert rows_on(1, [12]) == [4]  # both rows taken and unexpired (day 1 − day 0 < 2): 12 waits on the unknown row
    assert rows_on(1, [10]) == [first[0]]  # 10 seen on day 1 now
    assert rows_on(2, [12]) == [first[1]]  # 11 unseen since day 0 expired on day 2: its row goes to 12
    assert rows_on(2, [10]) == [first[0]]
    counts = remapper.take_counts()["t"]
    assert (counts["admitted"], counts["evicted"]) == (3, 1)  # 10 and 11 into free rows, then 12 in place of 11


def _held(remapper: ZchRemapper) -> dict[int, int]:
    """Id → row of every id a table ``t`` holds (TorchRec's buffers; an empty row, and MCH's sentinel, hold the
    largest int64)."""
    m = remapper.mch["t"]
    empty = torch.iinfo(torch.int64).max
    return {i: r for i, r in zip(m._mch_sorted_raw_ids.tolist(), m._mch_remapped_ids_mapping.tolist()) if i != empty}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(1, 25), min_size=1, max_size=8)), min_size=1, max_size=25),
       st.integers(3, 8), st.integers(1, 3))
def test_ttl_on_row_times_maps_as_ttl_on_days_when_every_time_is_a_day(steps, rows, ttl_days):
    """``ttl_clock=time`` with every row time at midnight of its day (the days in any order: the clock is the
    latest time so far) holds the same ids on the same rows as ``ttl_clock=day`` told those days."""
    by_day = ZchConfig(rows=rows, eviction="ttl", ttl_days=ttl_days, eviction_interval=1)
    by_time = ZchConfig(rows=rows, eviction="ttl", ttl_days=ttl_days, ttl_clock="time", eviction_interval=1)
    a = ZchRemapper(by_day, {"t": ["a"]}, by_day.table_sizes(["t"]))
    b = ZchRemapper(by_time, {"t": ["a"]}, by_time.table_sizes(["t"]))
    a.train(), b.train()
    latest = 0
    for day, ids in steps:
        latest = max(latest, day)
        a.set_day(latest)
        assert a(_kjt({"a": ids})).values().tolist() == b(_kjt({"a": ids}), 1_500_000_000 + day * 86_400).values().tolist()
        assert _held(a) == _held(b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.lists(st.integers(1, 30), min_size=1, max_size=8)), min_size=1, max_size=30),
       st.integers(3, 8), st.sampled_from([50, 120]))
def test_ttl_on_row_times_keeps_unexpired_ids_and_gives_new_ids_only_free_or_expired_rows(steps, rows, ttl):
    """Row times in seconds, in any order (the clock: the latest so far), TTL ``ttl`` seconds; after every
    round (interval 1), against the rule kept here: an id held and seen less than ``ttl`` ago keeps its row; a
    held id is one held before or seen in the round; an id of the round turned away means every row is held by an
    id seen less than ``ttl`` ago; no two ids share a row."""
    cfg = ZchConfig(rows=rows, eviction="ttl", ttl_days=ttl / 86_400, ttl_clock="time", eviction_interval=1)
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    remapper.train()
    clock, last = -1, {}  # last: held id → the clock when it was last seen
    for time, ids in steps:
        clock = max(clock, time)
        before = set(_held(remapper))
        remapper(_kjt({"a": ids}), time)
        held = _held(remapper)
        assert len(set(held.values())) == len(held) and all(FIRST_ROW <= r < rows + 1 for r in held.values())
        assert {i for i in before if clock - last[i] < ttl} <= set(held) <= before | set(ids)
        last = {i: clock if i in ids else last[i] for i in held}
        if set(ids) - set(held):
            assert len(held) == rows - 1 and all(clock - t < ttl for t in last.values())


def test_ttl_on_row_times_is_refused_without_them():
    from pipeline.data.store import with_table_sizes

    with pytest.raises(ValueError, match=r"model.zch.ttl_clock=time: only eviction=ttl reads a clock"):
        ZchConfig(rows=10, ttl_clock="time")
    with pytest.raises(ValueError, match=r"model.zch.ttl_days=0.5: expected a number of days >= 1"):
        ZchConfig(rows=10, eviction="ttl", ttl_days=0.5)
    cfg = ZchConfig(rows=10, eviction="ttl", ttl_clock="time")
    meta = {"id_dtype": "int64", "features": [{"name": "a", "table": "t"}], "time": None}
    with pytest.raises(ValueError, match=r"model.zch.ttl_clock=time: the store keeps no row times; .*data.time="):
        with_table_sizes(meta, cfg)
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    remapper.train()
    with pytest.raises(ValueError, match=r"ttl_clock=time: the training batches carry no row times"):
        remapper(_kjt({"a": [5]}))


def test_counts_are_kept_per_table():
    """Two tables of two id rows, LRU, a round every step; what each call must count, worked out by hand."""
    cfg = ZchConfig(rows=3, eviction_interval=1)
    remapper = ZchRemapper(cfg, {"t": ["a"], "u": ["b", "c"]}, cfg.table_sizes(["t", "u"]))
    remapper.train()
    remapper(_kjt({"a": [5, 6, 7], "b": [8, 8, 0], "c": [9, 0, 0]}))  # t: 3 new ids for 2 rows, one turned away
    remapper(_kjt({"a": [10, 10, 10], "b": [8, 9, 8], "c": [0, 0, 0]}))  # t: 10 evicts one; u: both held
    assert remapper.take_counts() == {"t": {"admitted": 3, "evicted": 1, "unknown": 1, "looked_up": 6, "occupancy": 1.0},
                                      "u": {"admitted": 2, "evicted": 0, "unknown": 0, "looked_up": 6, "occupancy": 1.0}}
    # counts start again; occupancy is the tables' state: t holds 2 ids in 2 rows
    assert remapper.take_counts()["t"] == {**dict.fromkeys(("admitted", "evicted", "unknown", "looked_up"), 0),
                                           "occupancy": 1.0}


def test_distance_lfu_keeps_a_frequent_id_until_its_count_over_the_rounds_since_seen_falls_behind():
    """TorchRec's DistanceLFU: score = occurrences / (rounds since last seen + 1). Id 10 seen 6 times in round 1
    against a new id seen twice a round (score 2, while the previous one's falls to 1): 10 keeps its row while
    6 / t > 1 and has lost it once 6 / t < 1."""
    cfg = ZchConfig(rows=3, eviction="distance_lfu", eviction_interval=1)  # two rows for ids
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    remapper.train()
    row_of_10 = remapper(_kjt({"a": [10] * 6 + [11]})).values().tolist()[0]
    unknown = 4
    for t in range(2, 9):
        remapper(_kjt({"a": [10 + t, 10 + t]}))
        held = lookup_rows(mapping_state(remapper), "t", np.array([10]))[0]
        if t <= 5:
            assert held == row_of_10, t
        elif t >= 8:
            assert held == unknown, t


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=10), min_size=1, max_size=25),
       st.integers(2, 3), st.integers(1, 12))
def test_probation_counts_new_ids_exactly_and_forgets_the_least_recently_seen(rounds, min_count, capacity):
    """The probation list against a dict of our own: per round, an id's occurrences add to its count; admitted once
    the count reaches min_count (and then off the list, as an id that took a row); past ``capacity`` ids, whole
    rounds leave, oldest first, until it fits."""
    from modules.embedding.zch.admission import ProbationAdmission

    probation = ProbationAdmission(min_count, capacity)
    ref: dict[int, tuple[int, int]] = {}  # id → (count, last round)
    for r, ids in enumerate(rounds):
        distinct, occurrences = torch.unique(torch.tensor(ids), return_counts=True)
        admitted = probation.admitted(distinct, occurrences, r)
        expected = []
        for x, n in zip(distinct.tolist(), occurrences.tolist()):
            count = ref.get(x, (0, 0))[0] + n
            ref[x] = (count, r)
            expected.append(count >= min_count)
        assert admitted.tolist() == expected
        probation.forget(distinct[admitted])
        for x in distinct[admitted].tolist():
            del ref[x]
        probation.trim()
        while len(ref) > capacity:
            oldest = min(last for _, last in ref.values())
            ref = {x: v for x, v in ref.items() if v[1] != oldest}
        assert probation.ids.tolist() == sorted(ref)
        assert probation.counts.tolist() == [ref[x][0] for x in sorted(ref)]


def test_min_count_keeps_an_id_on_the_unknown_row_until_seen_that_often():
    cfg = ZchConfig(rows=10, eviction_interval=1, min_count=3)
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    remapper.train()
    unknown = 11
    assert remapper(_kjt({"a": [5, 6, 6]})).values().tolist() == [unknown] * 3  # 5 once, 6 twice
    row = remapper(_kjt({"a": [6, 5]})).values().tolist()  # 6 a third time: a row; 5 twice: not yet
    assert row[1] == unknown and FIRST_ROW <= row[0] < unknown
    assert remapper(_kjt({"a": [5]})).values().tolist()[0] not in (unknown, row[0])
    state = mapping_state(remapper)  # the counts travel with the mapping (init_from continues them)
    again = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    load_mapping_state(again, state)
    assert torch.equal(again.admission["t"].counts, remapper.admission["t"].counts)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=12), min_size=1, max_size=20),
       st.integers(2, 3), st.integers(2, 6), st.integers(1, 2))
def test_a_bucketed_table_maps_each_id_as_its_buckets_own_table_would(steps, buckets, rows, min_count):
    """``model.zch.buckets = B``: an id of bucket b = id mod B gets the row a table of its own over that bucket's
    rows gives it (fed only that bucket's ids: one B = 1 remapper per bucket), shifted by b · rows; ids not held
    read the table's last row; the read-only lookup of the mapping agrees."""
    cfg = ZchConfig(rows=rows * buckets, eviction_interval=1, buckets=buckets, min_count=min_count)
    remapper = ZchRemapper(cfg, {"t": ["a"]}, cfg.table_sizes(["t"]))
    one = ZchConfig(rows=rows, eviction_interval=1, min_count=min_count)
    alone = [ZchRemapper(one, {"t": ["a"]}, one.table_sizes(["t"])) for _ in range(buckets)]
    for m in (remapper, *alone):
        m.train()
    unknown = rows * buckets + 1
    for ids in steps:
        got = remapper(_kjt({"a": ids})).values().tolist()
        for b, m in enumerate(alone):
            mine = [i for i in ids if i and i % buckets == b]
            expected = m(_kjt({"a": [0, *mine]})).values().tolist()[1:]  # 0: every bucket sees every step
            assert [g for i, g in zip(ids, got) if i and i % buckets == b] == \
                [unknown if r == rows + 1 else r + b * rows for r in expected]
        assert all(g == MISSING_ROW for i, g in zip(ids, got) if i == 0)
    remapper.eval()
    seen = sorted({i for ids in steps for i in ids} | {1_000_001})
    assert lookup_rows(mapping_state(remapper), "t", np.array(seen)).tolist() == remapper(_kjt({"a": seen})).values().tolist()


def test_buckets_that_cannot_split_the_rows_are_refused_and_a_mapping_continues_only_with_its_buckets():
    with pytest.raises(ValueError, match=r"model.zch.rows=1001: expected a multiple of model.zch.buckets=2"):
        ZchConfig(rows=1001, buckets=2)
    with pytest.raises(ValueError, match=r"model.zch.tables.C3=6: expected a multiple of model.zch.buckets=4"):
        ZchConfig(rows=8, buckets=4, tables={"C3": 6})
    with pytest.raises(ValueError, match=r"model.zch.rows=4: .* at least 2 rows a bucket"):
        ZchConfig(rows=4, buckets=4)
    from pipeline.config import compose_run_config
    from pipeline.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.zch\.rows=1001: expected a multiple"):  # the key named once
        compose_run_config(["data.preprocess.categorical=raw", "model.zch.rows=1001", "model.zch.buckets=2"])
    one, two = ZchConfig(rows=8), ZchConfig(rows=8, buckets=2)
    source = ZchRemapper(one, {"t": ["a"]}, one.table_sizes(["t"]))
    with pytest.raises(ValueError, match=r"does not fit this run's tables .*model.zch.buckets must be the source's"):
        load_mapping_state(ZchRemapper(two, {"t": ["a"]}, two.table_sizes(["t"])), mapping_state(source))


TWO_TABLES, ONE_TABLE = {"t": ["a", "b"], "u": ["c"]}, {"t": ["a", "b", "c"]}
CASES = ((TWO_TABLES, 1), (TWO_TABLES, 2), (ONE_TABLE, 1))  # (tables, buckets) of the 2-process remapper test


def _ranks_remap(rank: int, world: int, steps: list[dict[str, list[int]]], out: str) -> None:
    """For each case (tables, buckets), each rank remaps its half of every global batch (keys a, b, c); saves its
    rows, and on rank 0 the gathered mapping and the counts."""
    for case, (features, buckets) in enumerate(CASES):
        cfg = ZchConfig(rows=6, eviction_interval=2, buckets=buckets, min_count=2)
        remapper = ZchRemapper(cfg, features, cfg.table_sizes(list(features)))
        remapper.train()
        assert len(remapper.mch) == (len(remapper.units) + 1 - rank) // 2  # dealt evenly (one unit: rank 0's)
        rows = []
        for step in steps:
            half = len(step["a"]) // world
            rows.append(remapper(_kjt({k: v[rank * half:(rank + 1) * half] for k, v in step.items()})).values())
        mapping, counts = mapping_state(remapper), remapper.take_counts()
        held = (remapper.mapping_bytes(), remapper.exchange.largest(remapper.mapping_bytes()))
        torch.save({"rows": rows, "mapping": mapping, "counts": counts, "bytes": held}, f"{out}/case{case}-rank{rank}.pt")


def test_two_ranks_build_the_mapping_of_one_process_each_holding_half(tmp_path):
    """2 gloo processes, each remapping half of every global batch and holding the units (tables, or tables'
    buckets) dealt to it — two tables in one and in two buckets, and one table in one bucket (rank 1 holds none
    and only sends and receives): every rank's rows, the mapping gathered on rank 0 (bit for bit, probation lists
    too) and the counts equal one process remapping the global batches."""
    from tests.dist_utils import run_workers

    rng = np.random.default_rng(7)
    steps = [{k: rng.integers(0, 25, 8).tolist() for k in ("a", "b", "c")} for _ in range(9)]
    run_workers(_ranks_remap, 2, steps, str(tmp_path))
    for case, (features, buckets) in enumerate(CASES):
        cfg = ZchConfig(rows=6, eviction_interval=2, buckets=buckets, min_count=2)
        single = ZchRemapper(cfg, features, cfg.table_sizes(list(features)))
        single.train()
        ranks = [torch.load(tmp_path / f"case{case}-rank{r}.pt", weights_only=False) for r in range(2)]
        for i, step in enumerate(steps):
            rows = single(_kjt(step)).values().view(3, 8)  # keys a, b, c
            assert torch.equal(torch.cat([ranks[0]["rows"][i].view(3, 4), ranks[1]["rows"][i].view(3, 4)], 1), rows)
        mapping = mapping_state(single)
        assert sorted(ranks[0]["mapping"]) == sorted(mapping)
        assert all(np.array_equal(ranks[0]["mapping"][k], v) for k, v in mapping.items())
        assert ranks[0]["counts"] == ranks[1]["counts"] == single.take_counts()
        # the mapping's bytes: the ranks' shares add up to one process's (the gathered arrays' bytes), the largest known to both
        assert ranks[0]["bytes"][0] + ranks[1]["bytes"][0] == single.mapping_bytes() == sum(v.nbytes for v in mapping.values())
        assert ranks[0]["bytes"][1] == ranks[1]["bytes"][1] == max(ranks[0]["bytes"][0], ranks[1]["bytes"][0])


def test_raw_store_holds_one_id_per_table_and_value_and_no_vocabulary(small_overrides, tmp_path):
    """Raw ids against the raw file: equal values of a table share an id, any two different (table, value) pairs
    differ (no collision among the log's values), missing → 0; no vocabulary is written."""
    from pipeline.config import parse_config
    from pipeline.data.sources import prepare_store
    from tests.conftest import compose_config

    cfg = parse_config(compose_config([o for o in small_overrides if not o.startswith("paths.")] +
                                      [f"paths.cache_dir={tmp_path}", "data.synthetic.rows=3000",
                                       "data.preprocess.categorical=raw", "model.zch.rows=100",
                                       "data.preprocess.split.method=sequential", "data.preprocess.split.valid=0",
                                       "data.preprocess.split.test=0"]))
    store = prepare_store(cfg.data, cfg.paths.cache_dir)
    assert store.meta["id_dtype"] == "int64" and not list(store.root.glob("vocab/*.parquet"))
    ids = np.asarray(store.split("train").sparse)
    raw = [line.split("\t") for line in next((tmp_path / "raw").rglob("*.tsv")).read_text().splitlines()]
    assert ids.dtype == np.int64 and len(raw) == len(ids)
    first_cat = 1 + len(store.dense_names)
    pairs: dict[tuple[int, str], int] = {}
    for j in range(ids.shape[1]):
        for row, value in zip(ids[:, j], (r[first_cat + j] for r in raw)):
            if value == "":
                assert row == 0
            else:
                assert pairs.setdefault((j, value), int(row)) == row
    assert len(set(pairs.values())) == len(pairs) and 0 not in pairs.values()


ZCH_RUN = ["data.preprocess.categorical=raw", "model.zch.rows=3000", "model.zch.eviction_interval=4", "scaling=cowclip",
           "model.stack_tables=false",  # as the ssd tier decides: the same FBGEMM kernels in memory and on ssd
           "model.zch.min_count=2", "trainer.max_epochs=1"]


def _mapping(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The remapper's buffers in a checkpoint: TorchRec's (mch.*) and the admission counts."""
    return {k: v for k, v in tensors.items() if k.startswith("state_dict/zch.remapper.") and "_extra_state" not in k}


@pytest.fixture(scope="module")
def zch_straight(ckpt_overrides, tmp_path_factory):
    """1 process, LRU tables smaller than the ids, CowClip with the every-row L2, uninterrupted."""
    tmp = tmp_path_factory.mktemp("zch_straight")
    _, result = _run([*ckpt_overrides, *ZCH_RUN, f"trainer.checkpoint.dir={tmp}/ckpt"], tmp, nproc=1)
    return result, _tensors(complete_checkpoints(tmp / "ckpt")[-1])


def _killed_and_resumed(ckpt_overrides, tmp_path, nproc: int, zch_run: list[str] = ZCH_RUN):
    """Every table on the ssd tier behind a row cache (evicted ids' rows are reset through it), killed at step 13."""
    ckpt = tmp_path / "ckpt"
    args = [*ckpt_overrides, *zch_run, f"trainer.checkpoint.dir={ckpt}", f"topology.ssd.path={tmp_path}/ssd",
            "topology.ddr_cap_gb=1e-12", "topology.ssd.cache_mb=40"]
    stopped, _ = _run([*args, _kill(nproc - 1, 13)], tmp_path, nproc=nproc, check=False)
    assert stopped.returncode != 0 and complete_checkpoints(ckpt)[-1].name == "step-000000010"
    killed_run = _run_id_of(complete_checkpoints(ckpt)[-1])
    _, resumed = _run([*args, "trainer.resume=auto"], tmp_path, nproc=nproc)
    assert resumed.mlflow_run_id == killed_run  # it continued the killed run
    return resumed, _tensors(complete_checkpoints(ckpt)[-1])


def _replayed_mapping(overrides: list[str]) -> dict[str, torch.Tensor]:
    """The mapping a run's training batches build, computed without training: its store's global batches (the
    loader of one process, the run's seed) through a fresh remapper, in this process."""
    from modules.embedding.sparse_arch import FeatureSpec
    from pipeline.config import parse_config
    from pipeline.data.batches import BatchLoader
    from pipeline.data.sources import store_dir
    from pipeline.data.store import ColumnarStore, with_table_sizes
    from pipeline.training.zch_stage import ZchStage
    from tests.conftest import compose_config

    cfg = parse_config(compose_config(overrides))
    store = ColumnarStore(store_dir(cfg.data, cfg.paths.cache_dir))
    spec = FeatureSpec.from_store_meta(with_table_sizes(store.meta, cfg.model.zch))
    remapper = ZchStage(cfg.model.zch, spec, {}, 0).remapper
    remapper.train()
    loader = BatchLoader(store.split("train"), spec.kjt_keys, cfg.trainer.batch_size, 0, 1, True, cfg.seed,
                         categorical=store.categorical_names)
    for epoch in range(cfg.trainer.max_epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            remapper(batch.sparse_features)
    return {f"state_dict/zch.remapper.{k}": v for k, v in remapper.state_dict().items() if not k.endswith("_extra_state")}


def test_zch_on_two_ranks_killed_and_resumed_builds_the_mapping_of_its_batches(ckpt_overrides, tmp_path):
    """2 ranks, every table in 2 buckets (52 mappings, each rank holding 26), tables on the ssd tier, rank 1
    SIGKILLed at step 13, resume=auto from step 10 (between admission rounds: the pending ids come from each rank's
    checkpoint): every bucket's mapping — ids held, their rows, LRU state, probation counts — equals bit for bit
    the one the run's global batches build when replayed through a remapper in this process; tables filled up, so
    ids were evicted on the way."""
    zch_run = [*ZCH_RUN, "model.zch.buckets=2", "trainer.log_every_n_steps=5"]
    resumed, tensors = _killed_and_resumed(ckpt_overrides, tmp_path, nproc=2, zch_run=zch_run)
    # both ranks' tables were files (their folders' locks stay), deleted when the resumed run ended
    assert sorted(p.parent.name for p in (tmp_path / "ssd").glob("rank*/.lock")) == ["rank0", "rank1"]
    assert not list((tmp_path / "ssd").glob("rank[01]/*.f32"))
    mapping = _mapping(tensors)
    _assert_same(mapping, _replayed_mapping([*ckpt_overrides, *zch_run]), ("state_dict/zch.",))
    held: dict[str, int] = {}  # ids held per table, over its 2 buckets of 1,500 rows (1,499 ids each)
    for k, v in mapping.items():
        if k.endswith("_mch_sorted_raw_ids"):
            table = k.split(".")[3].split("@")[0]
            held[table] = held.get(table, 0) + int((v != torch.iinfo(torch.int64).max).sum())
    assert len(held) == 26 and list(held.values()).count(2998) >= 5
    # MLflow: the counts over both ranks, and the largest rank's share of the mapping — about half of it
    from mlflow import MlflowClient

    logged = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(resumed.mlflow_run_id).data.metrics
    total = sum(v.numel() * v.element_size() for v in mapping.values())
    assert 0.45 <= logged["zch/mapping_mb"] * 1e6 / total <= 0.6, (logged["zch/mapping_mb"], total)
    assert 0 < logged["zch/occupancy"] <= 1 and 0 <= logged["zch/unknown_share"] < 1 and logged["zch/admitted"] >= 0
    assert resumed.test_auc is not None
    # the model folder exported from the checkpoint keeps the same mapping and admission counts
    from pipeline.model_folder.export import export_model

    # (the model folder a 2-rank run writes gathers the ranks' mappings with mapping_state, tested with 2 processes above)
    exported = export_model(complete_checkpoints(tmp_path / "ckpt")[-1], tmp_path / "exported")
    with np.load(exported / "zch.npz") as saved:
        assert sorted(saved.files) == sorted(k[len("state_dict/zch.remapper."):] for k in mapping)
        for k, v in mapping.items():
            assert np.array_equal(saved[k[len("state_dict/zch.remapper."):]], v.numpy()), k
    # 2 ranks scoring the checkpoint, each mapping ids through its buckets only, against one process scoring the
    # export with the whole mapping: the same probabilities and the same count of ids on the unknown row
    from pipeline.scoring.prediction import PredictArgs, run
    from tests.test_model_use import command

    cache = Path(next(o.split("=", 1)[1] for o in ckpt_overrides if o.startswith("paths.cache_dir=")))
    rows = tmp_path / "rows.tsv"
    with next(cache.rglob("raw/*.tsv")).open() as f:
        rows.write_text("".join(line for _, line in zip(range(3000), f)))
    one = run(PredictArgs(checkpoint=str(exported), input=str(rows), output=str(tmp_path / "one.parquet")))
    proc = command("pipeline.commands.predict", f"checkpoint={tmp_path / 'ckpt'}", f"input={rows}",
                   f"output={tmp_path / 'sharded.parquet'}", launcher=["-m", "torch.distributed.run", "--nproc_per_node=2"])
    assert one.rows == 3000 and one.unseen[0] > 0
    assert f"model.zch: {one.unseen[0]:,} of {one.unseen[1]:,} raw ids" in proc.stdout
    np.testing.assert_allclose(pd.read_parquet(tmp_path / "sharded.parquet")["probability"].to_numpy(),
                               pd.read_parquet(tmp_path / "one.parquet")["probability"].to_numpy(), atol=1e-6)


@pytest.mark.slow
def test_zch_run_killed_and_resumed_ends_where_the_straight_run_ends(ckpt_overrides, zch_straight, tmp_path):
    """1 process, tables on the ssd tier: SIGKILL at step 13, resume=auto from step 10 ends on the tensors — the
    remapper's included — and metrics of the straight run with its tables in memory. (slow, 30 s: the 2-rank test above resumes the same way and checks the
    mapping bit for bit)"""
    straight, straight_tensors = zch_straight
    resumed, tensors = _killed_and_resumed(ckpt_overrides, tmp_path, nproc=1)
    assert (resumed.test_auc, resumed.test_logloss) == (straight.test_auc, straight.test_logloss)
    assert _mapping(tensors)
    _assert_same(tensors, straight_tensors, ("state_dict/", "fused_optimizer/"))


def test_predict_from_a_zch_model_folder_gives_the_runs_test_auc(own_data_run, tmp_path):
    """A ZCH run on the generated log (a multi-hot feature too): ``ctr predict`` on the raw rows of its test split —
    values hashed and mapped read-only with the model folder's mapping (numpy) — gives the AUC training measured on
    them through TorchRec's remap; a value never seen goes to the unknown row and is scored."""

    from pipeline.data.pass1 import assign_splits
    from pipeline.data.preprocess_config import SplitConfig
    from tests.conftest import train_cli

    folder, _, args, _, frame, _ = own_data_run
    split = assign_splits(np.arange(len(frame), dtype=np.uint64), len(frame), SplitConfig(valid=0.1, test=0.2, seed=0))
    frame[split == 2].to_csv(tmp_path / "test.csv", index=False)
    _, result = train_cli([*args, f"paths.cache_dir={tmp_path / 'cache'}", "data.preprocess.categorical=raw",
                           "model.zch.rows=300", "model.zch.min_count=2"], tmp_path / "run")
    model = tmp_path / "run" / "model"
    assert (model / "zch.npz").is_file()
    from pipeline.data.store import ColumnarStore
    from pipeline.scoring.prediction import PredictArgs, run

    prediction = run(PredictArgs(checkpoint=str(model), input=str(tmp_path / "test.csv"), output=str(tmp_path / "pred.parquet")))
    scores = pd.read_parquet(tmp_path / "pred.parquet")["probability"].to_numpy()
    # the count of raw ids scored on the unknown row: the test split's stored raw ids not held by the mapping
    store = ColumnarStore(next((tmp_path / "cache").rglob("meta.json")).parent).split("test")
    ids = np.concatenate([np.asarray(store.sparse).ravel(), *(np.asarray(r.values) for r in store.sequences.values())])
    ids = ids[ids != 0]
    with np.load(model / "zch.npz") as mapping:
        held = np.concatenate([mapping[k] for k in mapping.files if k.endswith("_mch_sorted_raw_ids")])
    assert prediction.unseen == (int((~np.isin(ids, held)).sum()), len(ids))
    from torchmetrics.functional.classification import binary_auroc

    labels = torch.from_numpy(frame[split == 2]["clicked"].to_numpy().astype(np.int64))
    assert abs(float(binary_auroc(torch.tensor(scores), labels)) - result.test_auc) <= 1e-6
    odd = frame[split == 2].head(2).drop(columns=["clicked"]).copy()
    odd.loc[odd.index[0], "user_id"] = "never-seen"
    odd.to_csv(tmp_path / "odd.csv", index=False)
    odd_prediction = run(PredictArgs(checkpoint=str(model), input=str(tmp_path / "odd.csv"), output=str(tmp_path / "odd.out.csv")))
    assert odd_prediction.rows == 2
    assert prediction.unseen[0] == 0 and odd_prediction.unseen[0] == 1  # every test value is held, "never-seen" is not
    assert len(pd.read_csv(tmp_path / "odd.out.csv")) == 2


def test_zch_needs_raw_ids(small_overrides, tmp_path):
    from pipeline.config import check_runnable, parse_config
    from pipeline.runtime.errors import ConfigError
    from tests.conftest import compose_config

    cfg = parse_config(compose_config([*small_overrides, "model.zch.rows=100"]))
    with pytest.raises(ConfigError, match=r"model.zch.rows=100 with data.preprocess.categorical=vocab"):
        check_runnable(cfg)
    with pytest.raises(ConfigError, match=r"model\.zch\.eviction='fifo'"):
        parse_config(compose_config([*small_overrides, "model.zch.eviction=fifo"]))
    with pytest.raises(ValueError, match=r"model.zch.tables.nope: no such table"):
        ZchConfig(rows=10, tables={"nope": 5}).table_sizes(["C1"])


def test_a_replay_in_file_order_evicts_by_the_rows_own_times(own_data_run, tmp_path):
    """A log sorted by time, trained in the files' order (``trainer.shuffle=false``) with a TTL of 29 minutes on the
    rows' times (``data.time``): the store keeps each row's time (against pandas' parse of the file), and the model
    folder's mapping is the one its training batches build through a remapper in this process, told each
    batch's latest time — ids changed hands as the clock passed their TTL."""

    from mlflow.tracking import MlflowClient

    from modules.embedding.sparse_arch import FeatureSpec
    from pipeline.data.batches import BatchLoader
    from pipeline.data.pass1 import assign_splits
    from pipeline.data.preprocess_config import SplitConfig
    from pipeline.data.store import ColumnarStore, with_table_sizes
    from pipeline.training.zch_stage import ZchStage
    from tests.conftest import train_cli
    from tests.test_model_use import predict_here

    _, _, args, _, frame, _ = own_data_run
    frame = frame.sort_values("click_time", kind="stable").reset_index(drop=True)
    frame.to_csv(tmp_path / "by_time.csv", index=False)
    cfg = ZchConfig(rows=120, eviction="ttl", ttl_days=0.02, ttl_clock="time", eviction_interval=2)
    _, result = train_cli([*args, f"data.path={tmp_path / 'by_time.csv'}", f"paths.cache_dir={tmp_path / 'cache'}",
               "data.preprocess.categorical=raw", "data.time=click_time", "trainer.shuffle=false", "trainer.max_epochs=1",
               f"model.zch.rows={cfg.rows}", "model.zch.eviction=ttl", f"model.zch.ttl_days={cfg.ttl_days}",
               "model.zch.ttl_clock=time", "model.zch.eviction_interval=2", "trainer.batch_size=128"], tmp_path / "run")
    store = ColumnarStore(next((tmp_path / "cache" / "stores").glob("mylog-*[!k]")))
    train = store.split("train")
    split = assign_splits(np.arange(len(frame), dtype=np.uint64), len(frame), SplitConfig(valid=0.1, test=0.2, seed=0))
    seconds = pd.to_datetime(frame["click_time"][split == 0]).to_numpy().astype("datetime64[s]").astype(np.int64)
    np.testing.assert_array_equal(train.time, seconds)

    spec = FeatureSpec.from_store_meta(with_table_sizes(store.meta, cfg))
    remapper = ZchStage(cfg, spec, {}, 0).remapper
    remapper.train()
    loader = BatchLoader(train, spec.kjt_keys, 128, 0, 1, True, categorical=store.categorical_names, shuffle=False)
    for batch in loader:
        remapper(batch.sparse_features, batch.time)
    assert sum(c["evicted"] for c in remapper.take_counts().values()) > 1000  # 3,767 when written
    trained = dict(np.load(tmp_path / "run" / "model" / "zch.npz"))
    replayed = mapping_state(remapper)
    assert sorted(trained) == sorted(replayed)
    for key, value in replayed.items():
        np.testing.assert_array_equal(trained[key], value, err_msg=key)
    # MLflow: each logged step's counts per table add up to its totals
    client = MlflowClient(next(a.split("=", 1)[1] for a in args if a.startswith("logger.tracking_uri=")))
    tables = list(dict.fromkeys(f["table"] for f in store.meta["features"]))
    for name in ("admitted", "evicted"):
        total = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, f"zch/{name}")}
        parts = [{m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, f"zch/{name}/{t}")}
                 for t in tables]
        assert sum(total.values()) > 0 and all(total[s] == sum(p[s] for p in parts) for s in total), name
    frame.head(50).drop(columns=["clicked"]).to_csv(tmp_path / "score.csv", index=False)  # the folder scores as any other
    assert len(predict_here(tmp_path / "run" / "model", tmp_path / "score.csv", tmp_path / "scores.csv")) == 50
