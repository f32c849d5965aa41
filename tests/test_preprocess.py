"""Preprocessing into the columnar store, checked against hand computations and pandas."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import pytest

from pipeline.config import parse_config
from pipeline.data.dataset import builtin_layout
from pipeline.data.preprocess import preprocess
from pipeline.data.preprocess_config import PreprocessConfig, SplitConfig
from pipeline.data.sources import prepare_store, store_dir
from tests.conftest import compose_config, shared_file
from tests.test_readers import key_of

CRITEO = builtin_layout("criteo")


@pytest.fixture()
def dac():
    return shared_file("criteo_sample/dac_sample.tsv")


def _row(label, dense, cats):
    dense = [("" if v is None else str(v)) for v in dense] + [""] * (13 - len(dense))
    cats = [("" if v is None else v) for v in cats] + ["00000000"] * (26 - len(cats))
    return "\t".join([str(label), *dense, *cats])


def test_round_trip_values_vocab_oov_missing(tmp_path):
    # C1 values over 8 training rows: aa x3, bb x2, cc x1, missing x2; test rows: aa, dd (unseen), missing, cc
    train = [("aa", 5), ("bb", None), ("aa", -2), ("cc", 0), (None, 7), ("bb", 1), ("aa", 3), (None, 10)]
    test = [("aa", 1), ("dd", 2), (None, None), ("cc", 4)]
    rows = [_row(i % 2, [v, 1], [c, "11111111"]) for i, (c, v) in enumerate(train + test)]
    path = tmp_path / "t.tsv"
    path.write_text("\n".join(rows) + "\n")
    cfg = PreprocessConfig(min_count=2, split=SplitConfig(method="sequential", valid=0.0, test=4 / 12))
    store = preprocess([path], builtin_layout("criteo", cfg), tmp_path / "store")
    assert store.meta["splits"] == {"train": 8, "valid": 0, "test": 4}
    # vocabulary: count >= 2, most frequent first -> aa=2, bb=3; cc rare -> OOV (0); missing -> 1
    assert store.table_sizes["C1"] == 2 + 2
    expect_id = {"aa": 2, "bb": 3, "cc": 0, "dd": 0, None: 1}
    tr, te = store.split("train"), store.split("test")
    assert tr.sparse[:, 0].tolist() == [expect_id[c] for c, _ in train]
    assert te.sparse[:, 0].tolist() == [expect_id[c] for c, _ in test]
    assert set(tr.sparse[:, 1].tolist()) == {2}  # constant column
    want_dense = [0.0 if v is None else math.log1p(max(v, 0)) for _, v in train]
    np.testing.assert_allclose(tr.dense[:, 0], want_dense, rtol=1e-6)
    np.testing.assert_allclose(tr.dense[:, 1], math.log1p(1), rtol=1e-6)
    assert tr.dense[:, 2:].max() == 0.0  # all missing
    assert tr.label.tolist() == [i % 2 for i in range(8)]
    stats = store.meta["stats"]["C1"]
    assert stats["distinct_train"] == 3 and stats["kept"] == 2 and stats["occurrences_train"] == 6


def test_real_criteo_sample_matches_pandas(tmp_path, dac):
    cfg = PreprocessConfig(min_count=3, split=SplitConfig(method="random", valid=0.0, test=0.0))
    store = preprocess([dac], builtin_layout("criteo", cfg), tmp_path / "dac")
    df = pd.read_csv(dac, sep="\t", header=None, names=list(CRITEO.columns), dtype={c: str for c in CRITEO.categorical})
    assert store.meta["splits"]["train"] == len(df) == 7577
    tr = store.split("train")
    np.testing.assert_array_equal(tr.label, df["label"].to_numpy())
    for j, c in enumerate(CRITEO.categorical):
        counts = df[c].value_counts()
        kept = counts[counts >= 3]
        order = sorted(kept.index, key=lambda v: (-kept[v], key_of(v.encode())))
        ids = {v: i + 2 for i, v in enumerate(order)}
        want = [1 if pd.isna(v) else ids.get(v, 0) for v in df[c]]
        assert store.table_sizes[c] == len(order) + 2, c
        np.testing.assert_array_equal(tr.sparse[:, j], want, err_msg=c)
    dense = df[list(CRITEO.numeric)].to_numpy(dtype=np.float64)
    np.testing.assert_allclose(tr.dense, np.nan_to_num(np.log1p(np.maximum(dense, 0)), nan=0.0), rtol=1e-6)


def test_random_split_is_deterministic_and_independent_of_block_size(tmp_path, dac):
    cfg = PreprocessConfig(min_count=1, split=SplitConfig(method="random", valid=0.1, test=0.2, seed=5))
    a = preprocess([dac], builtin_layout("criteo", cfg), tmp_path / "a")
    b = preprocess([dac], builtin_layout("criteo", PreprocessConfig(min_count=1, split=cfg.split, block_size=1 << 16)), tmp_path / "b")
    n = a.meta["splits"]
    assert sum(n.values()) == 7577
    assert abs(n["valid"] / 7577 - 0.1) < 0.015 and abs(n["test"] / 7577 - 0.2) < 0.015
    for split in ("train", "valid", "test"):
        sa, sb = a.split(split), b.split(split)
        np.testing.assert_array_equal(sa.sparse, sb.sparse)
        np.testing.assert_array_equal(sa.dense, sb.dense)


def test_store_is_cached_and_keyed_by_inputs(cache_dir, dac):
    cfg = parse_config(compose_config([f"paths.cache_dir={cache_dir}", "data=criteo_kaggle", f"data.path={dac}"]))
    first = prepare_store(cfg.data, cfg.paths.cache_dir)
    stamp = os.stat(first.root / "meta.json").st_mtime_ns
    again = prepare_store(cfg.data, cfg.paths.cache_dir)
    assert again.root == first.root and os.stat(again.root / "meta.json").st_mtime_ns == stamp
    other = compose_config([f"paths.cache_dir={cache_dir}", "data=criteo_kaggle", f"data.path={dac}",
                            "data.preprocess.min_count=3"])
    assert store_dir(parse_config(other).data, cache_dir) != first.root


def test_failed_build_leaves_no_store(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text(_row(0, [1], ["aa"]) + "\n" + "1\tnot-a-number\n")
    target = tmp_path / "store"
    with pytest.raises(Exception):
        preprocess([bad], builtin_layout("criteo", PreprocessConfig()), target)
    assert not target.exists()
    assert not list(tmp_path.glob("store.tmp-*"))


def test_empty_file_is_refused_with_its_name(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(Exception, match="empty"):
        preprocess([empty], builtin_layout("criteo", PreprocessConfig()), tmp_path / "s")


def test_split_leaving_no_training_rows_gives_empty_vocabularies(tmp_path):
    """Found by the fuzz test: three rows, none drawn for training — every vocabulary is empty and every
    value of the valid / test rows is OOV, instead of an IndexError in the id lookup."""
    from pipeline.data.dataset import builtin_layout
    from pipeline.data.preprocess_config import PreprocessConfig, SplitConfig

    (tmp_path / "in.csv").write_bytes(
        b"label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city\r\n"
        b"1,266,1244,5042,5049,5054,5055,5058,5062,5074,5149\r\n0,138,1296,5041,5052,5053,5055,5058,5061,5085,5201\r\n"
        b"0,317,1694,5041,5047,5053,5055,5058,5061,5070,")
    cfg = PreprocessConfig(min_count=1, split=SplitConfig(valid=0.2, test=0.2))
    store = preprocess([tmp_path / "in.csv"], builtin_layout("frappe", cfg), tmp_path / "store")
    assert store.meta["splits"] == {"train": 0, "valid": 1, "test": 2}
    assert all(n == 2 for n in store.table_sizes.values())  # OOV and missing rows only
    for split in ("valid", "test"):
        assert (np.asarray(store.split(split).sparse) <= 1).all()


def test_hashed_tables_meet_no_more_rows_than_their_distinct_values(tmp_path, dac):
    """Placement sizes a hashed table's least row cache by its distinct training values (coverage share 1.0),
    not by the batch: the rows the training split meets are at most those values and the missing row."""
    from modules.sharding.placement import UNSEEN_MARGIN
    from pipeline.data.datamodule import CTRDataModule

    cfg = PreprocessConfig(categorical="hash", hash_buckets=1 << 20, split=SplitConfig(method="random", valid=0.0, test=0.2))
    data = builtin_layout("criteo", cfg)
    module = CTRDataModule(data, tmp_path, 1024, 1024, 0)
    module.store = preprocess([dac], data, tmp_path / "store")
    df = pd.read_csv(dac, sep="\t", header=None, names=list(CRITEO.columns), dtype={c: str for c in CRITEO.categorical})
    train, test = module.store.split("train"), module.store.split("test")
    assert module.store.meta["splits"]["train"] == len(train.label) < len(df)
    for j, c in enumerate(CRITEO.categorical):
        coverage = module.coverage[c]
        met = np.unique(train.sparse[:, j])
        assert coverage[1.0] == module.store.meta["stats"][c]["distinct_train"] >= coverage[0.99], c
        assert len(met) - 1 <= coverage[1.0] <= df[c].nunique(), c  # at most the missing row besides the values
        # the margin for values new in a random evaluation split (UNSEEN_MARGIN), on real data: the whole test
        # split (a fifth of the sample, one evaluation batch) meets no more rows than it allows
        assert len(np.unique(test.sparse[:, j])) <= UNSEEN_MARGIN * (coverage[1.0] + 2), c
    # a sequential split's evaluation rows may meet values training never did: no count to size caches by
    sequential = builtin_layout("criteo", PreprocessConfig(categorical="hash", split=SplitConfig(method="sequential")))
    module = CTRDataModule(sequential, tmp_path, 1024, 1024, 0)
    module.store = preprocess([dac], sequential, tmp_path / "sequential")
    assert all(1.0 not in levels and levels for levels in module.coverage.values())
