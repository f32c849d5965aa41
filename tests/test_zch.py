"""Raw 64-bit ids and zero-collision tables (model.zch): the mapping against independent references
(an LRU bookkeeping of our own, the TTL rule), the raw store, and a killed run resumed exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import KeyedJaggedTensor

from modules.zch import FIRST_ROW, MISSING_ROW, ZchConfig, ZchRemapper, lookup_rows, mapping_state
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
    # serving's read-only remap (numpy, the model folder's mapping) equals TorchRec's in evaluation
    probe = [0, 1_000_000, *sorted(last)]
    assert lookup_rows(mapping_state(remapper), "t", np.array(probe)).tolist() == \
        remapper(_kjt({"a": probe})).values().tolist()


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
    counts = remapper.take_counts()
    assert (counts["admitted"], counts["evicted"]) == (3, 1)  # 10 and 11 into free rows, then 12 in place of 11


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


def test_zch_run_killed_and_resumed_ends_where_the_straight_run_ends(ckpt_overrides, tmp_path):
    """1 process, LRU tables smaller than the ids (evictions every few steps), CowClip with the every-row L2:
    SIGKILL at step 13, resume=auto from step 10 (between two admission rounds: the pending ids come from the
    checkpoint) ends on the straight run's tensors — the remapper's included — metrics and MLflow run."""
    zch = [*ckpt_overrides, "data.preprocess.categorical=raw", "model.zch.rows=3000", "model.zch.eviction_interval=4",
           "scaling=cowclip", "trainer.max_epochs=1"]
    ckpt = tmp_path / "ckpt"
    stopped, _ = _run([*zch, f"trainer.checkpoint.dir={ckpt}", _kill(0, 13)], tmp_path, nproc=1, check=False)
    assert stopped.returncode != 0 and complete_checkpoints(ckpt)[-1].name == "step-000000010"
    killed_run = _run_id_of(complete_checkpoints(ckpt)[-1])
    _, resumed = _run([*zch, f"trainer.checkpoint.dir={ckpt}", "trainer.resume=auto"], tmp_path, nproc=1)
    assert resumed.mlflow_run_id == killed_run
    straight_ckpt = tmp_path / "straight"
    _, straight = _run([*zch, f"trainer.checkpoint.dir={straight_ckpt}"], tmp_path / "s", nproc=1)
    assert (resumed.test_auc, resumed.test_logloss) == (straight.test_auc, straight.test_logloss)
    a, b = (_tensors(complete_checkpoints(c)[-1]) for c in (ckpt, straight_ckpt))
    assert any(k.startswith("state_dict/zch.remapper.mch.") for k in a)
    _assert_same(a, b, ("state_dict/", "fused_optimizer/"))
    held = [int((a[k] != torch.iinfo(torch.int64).max).sum()) for k in a if k.endswith("_mch_sorted_raw_ids")]
    assert len(held) == 26 and held.count(2999) >= 5  # tables full: ids were evicted on the way


def test_zch_needs_raw_ids_and_one_process(small_overrides, tmp_path):
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
