"""A user's own data declared in a YAML file: training from a config folder outside the repo, multi-hot
features, formats giving identical stores, shared tables, libsvm, and the errors of bad declarations
and bad files."""

from __future__ import annotations

import gzip

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from omegaconf import OmegaConf

from pipeline.data.dataset import DataConfig
from pipeline.data.preprocess import preprocess
from pipeline.runtime.errors import BadInputError
from tests.click_logs import DATASET_YAML, oracle_auc, write_dataset
from tests.conftest import train_cli


def declaration(text: str = DATASET_YAML, **changes) -> DataConfig:
    node = OmegaConf.merge(OmegaConf.structured(DataConfig), yaml.safe_load(text), changes)
    return OmegaConf.to_object(node)


@pytest.fixture(scope="module")
def log(own_data_run):
    folder, _, _, _, frame, p = own_data_run
    return folder, frame, oracle_auc(frame, p)


def test_yaml_dataset_outside_the_repo_trains_and_its_multi_hot_column_matters(own_data_run):
    # the run: `python -m pipeline.commands.train --config-dir <folder outside the repo> data=mylog data.path=<csv>`
    folder, _, args, result, frame, p = own_data_run
    oracle = oracle_auc(frame, p)
    # without the multi-hot column the label's main signal is gone
    without = write_dataset(folder / "conf_no_tags", "\n".join(line for line in DATASET_YAML.splitlines()
                                                                if "name: tags" not in line) + "\n").parent.parent
    proc, result_without = train_cli(["--config-dir", str(without), *args[2:], "logger.model_max_gb=0"],
                                     folder / "run_no_tags")
    # tables over logger.model_max_gb: no model folder, no MLflow model, and the way to score instead
    assert "no model folder and no MLflow model; score with ctr predict" in proc.stdout
    assert not (folder / "run_no_tags" / "model").exists()
    numbers = f"oracle {oracle:.4f}, with tags {result.test_auc:.4f}, without {result_without.test_auc:.4f}"
    assert result.test_auc >= oracle - 0.025, numbers
    assert result_without.test_auc <= result.test_auc - 0.1, numbers


NOISE = ("LeafSpec", "is_fx_tracing", "Downloading artifacts", "deprecating ShardedTensor")


def test_a_run_prints_no_library_noise_and_library_filters_keep_other_warnings(own_data_run):
    """The run that logged and registered its model printed none of the libraries' notes that are not the
    user's business (pipeline/runtime/library_noise.py); the filters take those messages only."""
    import warnings

    from pipeline.runtime.library_noise import quiet_libraries

    printed = (own_data_run[0] / "run.log").read_text()
    assert "RESULT " in printed and not [n for n in NOISE if n in printed], [n for n in NOISE if n in printed]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("tables x: our own warning", FutureWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", UserWarning)
    assert [str(w.message) for w in seen] == ["tables x: our own warning",
                                             "Please use DTensor instead and we are deprecating ShardedTensor."]


def test_csv_tsv_gz_and_parquet_give_identical_stores(log, tmp_path):
    _, frame, _ = log
    rows = frame.iloc[:5000]
    csv, tsv, parquet, lists = (tmp_path / n for n in ("a.csv", "b.tsv.gz", "c.parquet", "d.parquet"))
    rows.to_csv(csv, index=False)
    with gzip.open(tsv, "wt") as fh:
        rows.to_csv(fh, index=False, sep="\t")
    rows.to_parquet(parquet, index=False)
    as_lists = rows.assign(tags=rows["tags"].str.split("|"))  # a list<string> column needs no separator
    pq.write_table(pa.Table.from_pandas(as_lists, preserve_index=False), lists)
    stores = [preprocess([csv], declaration(), tmp_path / "s_csv"),
              preprocess([tsv], declaration(format="tsv"), tmp_path / "s_tsv"),
              preprocess([parquet], declaration(format="parquet"), tmp_path / "s_parquet"),
              preprocess([lists], declaration(format="parquet"), tmp_path / "s_lists")]
    first = stores[0]
    assert first.sequence_names == ["tags"] and first.categorical_names == ["user_id", "hour"]
    for other in stores[1:]:
        for split in ("train", "valid", "test"):
            a, b = first.split(split), other.split(split)
            for name in ("label", "dense", "sparse"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{other.root} {name}")
            np.testing.assert_array_equal(a.sequences["tags"].values, b.sequences["tags"].values)
            np.testing.assert_array_equal(a.sequences["tags"].offsets, b.sequences["tags"].offsets)
        assert first.meta["table_sizes"] == other.meta["table_sizes"]
    # the store's bags are the rows' tags: sizes and the vocabulary lookups agree with pandas
    train = first.split("train")
    sizes = np.diff(train.sequences["tags"].offsets)
    assert sizes.sum() == len(train.sequences["tags"].values) and sizes.min() >= 1
    tags = rows["tags"].str.split("|").explode()
    kept = tags.value_counts()
    assert first.table_sizes["tags"] >= 2 + 1 and first.table_sizes["tags"] - 2 <= int((kept >= 2).sum())


ITEM_HIST = """
format: csv
header: true
label: y
features:
  - {name: item, type: categorical}
"""


def test_raw_ids_in_one_pass_give_the_two_pass_store_with_one_id_per_value(log, tmp_path):
    """``categorical: raw`` (one pass, min-max rescaled at the end) against the vocabulary's two passes with every
    value kept: the same rows in each split, the same labels, numeric features (min-max included) and bags; and one
    raw id per (table, value) exactly where the vocabulary has one id per value."""
    from pipeline.data.encoding import raw_ids
    from tests.test_readers import key_of

    _, frame, _ = log
    rows = frame.iloc[:6000]
    csv = tmp_path / "a.csv"
    rows.to_csv(csv, index=False)
    text = DATASET_YAML.replace("transform: log1p", "transform: minmax")
    small = {"block_size": 40_000}  # several blocks: the range grows over them before the rescale
    vocab = preprocess([csv], declaration(text, preprocess={**small, "min_count": 1}), tmp_path / "vocab")
    raw = preprocess([csv], declaration(text, preprocess={**small, "categorical": "raw"}), tmp_path / "raw")
    assert raw.meta["splits"] == vocab.meta["splits"] and raw.meta["dense_range"] == vocab.meta["dense_range"]
    assert raw.meta["id_dtype"] == "int64" and not (tmp_path / "raw" / "vocab").exists()
    pairs: dict[tuple[int, int], int] = {}  # (column, vocabulary id) → raw id, over the training rows
    for split in ("train", "valid", "test"):
        a, b = vocab.split(split), raw.split(split)
        np.testing.assert_array_equal(a.label, b.label)
        np.testing.assert_array_equal(a.dense, b.dense)
        assert 0 < b.dense.max() <= 1 and b.dense.min() >= 0  # rescaled, not the parsed prices
        np.testing.assert_array_equal(a.sequences["tags"].offsets, b.sequences["tags"].offsets)
        columns = [(a.sparse[:, j], b.sparse[:, j]) for j in range(a.sparse.shape[1])]
        columns.append((a.sequences["tags"].values, b.sequences["tags"].values))
        for j, (ids, raws) in enumerate(columns):
            known = ids > 1 if split != "train" else np.ones(len(ids), bool)  # valid/test: values seen in training
            for v, r in zip(ids[known].tolist(), raws[known].tolist()):
                assert pairs.setdefault((j, v), r) == r, (split, j, v)
    assert len(set(pairs.values())) == len(pairs)  # one id per (table, value), none shared
    # every row in training: the ids are those of the rows' values, in file order
    whole = preprocess([csv], declaration(text, preprocess={"categorical": "raw", "split": {"valid": 0, "test": 0}}),
                       tmp_path / "whole")
    keys = np.array([key_of(v.encode()) for v in rows["user_id"]], np.uint64)
    np.testing.assert_array_equal(whole.split("train").sparse[:, 0], raw_ids(keys, "user_id"))


def test_shared_table_one_vocabulary_counted_over_both_features(tmp_path):
    frame = pd.DataFrame({"y": [0, 1, 0, 1, 1, 0], "item": ["a", "b", "c", "a", "d", "e"],
                          "hist": ["b|c", "a", "", "d|d|a", "e", "x"]})
    frame.to_csv(tmp_path / "f.csv", index=False)
    data = declaration(ITEM_HIST + """  - {name: hist, type: sequence, separator: "|", share_table_with: item}
preprocess: {min_count: 2, split: {method: random, valid: 0.0, test: 0.0}}
""")
    store = preprocess([tmp_path / "f.csv"], data, tmp_path / "s")
    counts = pd.concat([frame["item"], frame["hist"].str.split("|").explode()]).replace("", np.nan).dropna().value_counts()
    assert store.table_sizes == {"item": int((counts >= 2).sum()) + 2}  # one table: a, b, c, d, e... counted together
    train = store.split("train")
    ids_item = dict(zip(frame["item"], train.sparse[:, 0]))
    hist = train.sequences["hist"]
    bags = [hist.values[hist.offsets[i]:hist.offsets[i + 1]].tolist() for i in range(len(frame))]
    assert bags[0] == [ids_item["b"], ids_item["c"]] and bags[3] == [ids_item["d"], ids_item["d"], ids_item["a"]]
    assert bags[2] == [1] and bags[5] == [0]  # an empty bag: one missing id; a value seen once: OOV
    assert [f["table"] for f in store.meta["features"]] == ["item", "item"]


def test_libsvm_plain_and_field_aware(tmp_path):
    lines = ["1 3:1 10:1 12:0.5", "0 4:1 11:1", "1 3:1 10:1 11:1 12:1", "0 5:1 10:1"]
    (tmp_path / "f.svm").write_text("\n".join(lines) + "\n")
    split = {"min_count": 1, "split": {"method": "random", "valid": 0.0, "test": 0.0}}
    plain = preprocess([tmp_path / "f.svm"], declaration("format: libsvm", preprocess=split), tmp_path / "a")
    bags = plain.split("train").sequences["features"]
    assert np.diff(bags.offsets).tolist() == [3, 2, 4, 2] and plain.split("train").label.tolist() == [1, 0, 1, 0]
    fields = declaration("""
format: libsvm
features:
  - {name: user, type: categorical, index_range: [0, 10]}
  - {name: items, type: sequence, index_range: [10, 20], pooling: mean}
""", preprocess=split)
    store = preprocess([tmp_path / "f.svm"], fields, tmp_path / "b")
    users = store.split("train").sparse[:, 0]
    assert users[0] == users[2] != users[1] != users[3]  # index 3 twice, 4 and 5 once
    assert np.diff(store.split("train").sequences["items"].offsets).tolist() == [2, 1, 3, 1]


# -- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"features": [{"name": "x", "type": "embedding"}]}, r"type='embedding': expected one of \['categorical'"),
    ({"features": [{"name": "tags", "type": "sequence"}]}, r"features\[0\]\.separator is missing"),
    ({"features": [{"name": "h", "type": "categorical", "share_table_with": "nope"}]},
     r"features\[0\]\.share_table_with='nope': expected a categorical or sequence feature"),
    ({"features": [{"name": "p", "type": "numeric", "transform": "sqrt"}]}, r"transform='sqrt'"),
    ({"format": "xlsx"}, r"format='xlsx': expected one of"),
])
def test_bad_declarations_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        declaration(**change)


def test_bad_declaration_from_the_command_line_is_one_line_with_the_full_key(tmp_path):
    conf = write_dataset(tmp_path / "conf", DATASET_YAML.replace("type: numeric", "type: number")).parent.parent
    (tmp_path / "log.csv").write_text("clicked,user_id,price,click_time,tags\n1,u1,2,2017-11-07 09:30:38,t1\n")
    proc, _ = train_cli(["--config-dir", str(conf), "data=mylog", f"data.path={tmp_path / 'log.csv'}"],
                        tmp_path / "run", check=False)
    assert proc.returncode == 2
    assert "data.features[1].type='number': expected one of ['categorical', 'numeric', 'sequence']" in proc.stderr


def _bad(tmp_path, text: str, data: DataConfig, name: str = "bad.csv"):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BadInputError) as e:
        preprocess([path], data, tmp_path / "store")
    assert not (tmp_path / "store").exists()
    return str(e.value).replace(str(path), name)


HEADER = "clicked,user_id,price,click_time,tags\n"
GOOD = "1,u1,2.5,2017-11-07 09:30:38,t1|t2\n"


def test_bad_files_say_file_line_and_what_was_expected(tmp_path):
    d = declaration()
    assert _bad(tmp_path, "clicked,user,price,click_time,tags\n" + GOOD, d).startswith(
        "bad.csv:1: the header lacks column 'user_id' (declared in data=mylog); the file has ['clicked', 'user', ")
    assert _bad(tmp_path, HEADER + GOOD + "2,u1,2.5,2017-11-07 09:30:38,t1\n", d) == \
        "bad.csv:3: column 'clicked' has '2'; expected 0 or 1"
    assert _bad(tmp_path, HEADER + GOOD + "0,u1,cheap,2017-11-07 09:30:38,t1\n", d) == \
        "bad.csv:3: column 'price' has 'cheap'; expected a number or nothing"
    assert _bad(tmp_path, HEADER + GOOD * 2 + "0,u1,1,07/11/2017,t1\n", d) == \
        ("bad.csv:4: column 'click_time' has '07/11/2017'; expected a time like 2017-11-07 09:30:38 "
         "(time_format: iso) (feature 'hour', derive: hour_of_day)")
    strict = declaration(features=[{"name": "tags", "type": "sequence", "separator": "|", "max_length": 2,
                                    "too_long": "error"}])
    assert _bad(tmp_path, HEADER + GOOD + "0,u1,1,2017-11-07 09:30:38,a|b|c\n", strict) == \
        ("bad.csv:3: column 'tags' has 3 values; expected at most max_length=2 (feature 'tags'; "
         "too_long: truncate keeps the first)")


def test_long_sequences_are_truncated_and_counted(tmp_path):
    (tmp_path / "f.csv").write_text(HEADER + GOOD + "0,u1,1,2017-11-07 09:30:38,a|b|c|d\n" + GOOD)
    d = declaration(features=[{"name": "tags", "type": "sequence", "separator": "|", "max_length": 2}],
                    preprocess={"min_count": 1, "split": {"method": "random", "valid": 0.0, "test": 0.0}})
    store = preprocess([tmp_path / "f.csv"], d, tmp_path / "s")
    assert store.meta["truncated_rows"] == {"tags": 1}
    assert np.diff(store.split("train").sequences["tags"].offsets).tolist() == [2, 2, 2]


def test_parquet_with_a_wrong_column_type(tmp_path):
    frame = pd.DataFrame({"clicked": [1, 0], "user_id": ["u1", "u2"], "price": ["1.5", "2"],
                          "click_time": ["2017-11-07 09:30:38"] * 2, "tags": ["a", "b"]})
    frame.to_parquet(tmp_path / "f.parquet", index=False)
    with pytest.raises(BadInputError, match=r"f\.parquet: column 'price' has type (large_)?string; expected a numeric column"):
        preprocess([tmp_path / "f.parquet"], declaration(format="parquet"), tmp_path / "s")
    frame.drop(columns=["tags"]).assign(price=1.5).to_parquet(tmp_path / "g.parquet", index=False)
    with pytest.raises(BadInputError, match=r"g\.parquet: no column 'tags' \(declared in data=mylog\); the file has "
                                            r"\['clicked', 'user_id', 'price', 'click_time'\]"):
        preprocess([tmp_path / "g.parquet"], declaration(format="parquet"), tmp_path / "s")


def test_hashed_sequences_use_the_categorical_hash(tmp_path):
    (tmp_path / "f.csv").write_text("y,item,hist\n1,a,a|b\n0,b,\n1,c,c|a|zz\n")
    data = declaration(ITEM_HIST + """  - {name: hist, type: sequence, separator: "|"}
preprocess: {categorical: hash, hash_buckets: 97, split: {method: random, valid: 0.0, test: 0.0}}
""")
    store = preprocess([tmp_path / "f.csv"], data, tmp_path / "s")
    train = store.split("train")
    item = dict(zip("abc", train.sparse[:, 0]))
    hist = train.sequences["hist"]
    assert hist.values.tolist()[:3] == [item["a"], item["b"], 1] and hist.values[3:5].tolist() == [item["c"], item["a"]]
    assert store.table_sizes == {"item": 99, "hist": 99} and 2 <= hist.values[5] < 99
