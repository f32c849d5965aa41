"""Real-data readers (Criteo, Avazu, Frappe), hashing, transforms, splits and the bad-input policy."""

from __future__ import annotations

import datetime

import numpy as np
import pandas as pd
import pytest

from pipeline.data.dataset import builtin_layout
from pipeline.data.preprocess import preprocess
from pipeline.data.preprocess_config import PreprocessConfig, SplitConfig
from pipeline.runtime.errors import BadInputError
from tests.conftest import shared_file

CRITEO = builtin_layout("criteo")


def _criteo_line(label="1", dense=None, cats=None) -> str:
    dense = list(dense or ["1"] * 13)
    cats = list(cats or ["68fd1e64"] * 26)
    return "\t".join([label, *dense, *cats])


def test_criteo_hashing_matches_python_reference(tmp_path):
    dac = shared_file("criteo_sample/dac_sample.tsv")
    cfg = PreprocessConfig(categorical="hash", hash_buckets=1000, split=SplitConfig(valid=0.0, test=0.0))
    store = preprocess([dac], builtin_layout("criteo", cfg), tmp_path / "h")
    df = pd.read_csv(dac, sep="\t", header=None, names=list(CRITEO.columns), dtype=str, keep_default_na=False)
    tr = store.split("train")
    assert store.table_sizes == {c: 1002 for c in CRITEO.categorical}
    for j, c in enumerate(CRITEO.categorical[:6]):
        want = [1 if v == "" else 2 + key_of(v.encode()) % 1000 for v in df[c]]
        np.testing.assert_array_equal(tr.sparse[:, j], want, err_msg=c)
    assert store.meta["stats"]["C1"]["occurrences_train"] == int((df["C1"] != "").sum())


def test_minmax_and_sequential_split(tmp_path):
    dac = shared_file("criteo_sample/dac_sample.tsv")
    cfg = PreprocessConfig(split=SplitConfig(method="sequential", valid=0.0, test=1 / 7))
    layout = builtin_layout("criteo", cfg)
    for f in layout.features:
        if f.type == "numeric":
            f.transform = "minmax"
    store = preprocess([dac], layout, tmp_path / "m")
    n_test = store.meta["splits"]["test"]
    assert n_test == round(7577 / 7)
    df = pd.read_csv(dac, sep="\t", header=None, names=list(CRITEO.columns))
    train, test = df.iloc[:-n_test], df.iloc[-n_test:]
    np.testing.assert_array_equal(store.split("test").label, test["label"].to_numpy())
    for j, c in enumerate(CRITEO.numeric):
        lo, hi = train[c].min(), train[c].max()
        want = np.nan_to_num(np.clip((test[c].to_numpy(float) - lo) / (hi - lo), 0, 1), nan=0.0)
        np.testing.assert_allclose(store.split("test").dense[:, j], want, rtol=1e-6, atol=1e-7, err_msg=c)


def test_avazu_sample(tmp_path):
    path = shared_file("avazu_sample/avazu_sample.csv")
    store = preprocess([path], builtin_layout("avazu", PreprocessConfig(min_count=2, split=SplitConfig(valid=0.0, test=0.0))), tmp_path / "a")
    df = pd.read_csv(path, dtype=str)
    assert store.meta["splits"]["train"] == len(df) == 8087
    assert "id" not in store.categorical_names and "hour" not in store.categorical_names
    tr = store.split("train")
    np.testing.assert_array_equal(tr.label, df["click"].astype(int).to_numpy())
    hour = df["hour"].astype(int)
    derived = {
        "hour_of_day": [f"{h % 100:02d}" for h in hour],
        "weekday": [str(datetime.date(2000 + h // 1_000_000, h // 10_000 % 100, h // 100 % 100).weekday()) for h in hour],
    }
    for name in ("site_id", "device_ip", "C14", "hour_of_day", "weekday"):
        values = pd.Series(derived[name]) if name in derived else df[name]
        counts = values.value_counts()
        kept = counts[counts >= 2]
        order = {v: i + 2 for i, v in enumerate(sorted(kept.index, key=lambda v: (-kept[v], key_of(v.encode()))))}
        j = store.categorical_names.index(name)
        np.testing.assert_array_equal(tr.sparse[:, j], [order.get(v, 0) for v in values], err_msg=name)
    assert set(derived["weekday"]) == {"1"}  # 2014-10-21 was a Tuesday


def test_frappe_given_splits_and_oov_from_train_only(tmp_path):
    files = {s: [shared_file(f"frappe_x1/{s}.csv")] for s in ("train", "valid", "test")}
    store = preprocess(files, builtin_layout("frappe", PreprocessConfig(min_count=3, split=SplitConfig(method="given"))), tmp_path / "f")
    assert store.meta["splits"] == {"train": 202_027, "valid": 57_722, "test": 28_860}
    train, test = (pd.read_csv(files[s][0], dtype=str) for s in ("train", "test"))
    j = store.categorical_names.index("user")
    counts = train["user"].value_counts()  # counted on the training file only
    oov = (test["user"].map(counts).fillna(0) < 3).to_numpy()
    assert oov.sum() > 0
    te = store.split("test").sparse[:, j]
    assert (te[oov] == 0).all() and (te[~oov] >= 2).all()
    assert store.table_sizes["user"] == int((counts >= 3).sum()) + 2


BAD_CASES = {
    # name: (line to corrupt (1-based), replacement, message fragments, skip-count key)
    "wrong_column_count": (3, "1\t2\t3", ["bad.tsv:3:", "3 columns, expected 40"], "wrong_column_count"),
    "not_a_number": (4, _criteo_line(dense=["1"] * 4 + ["abc"] + ["1"] * 8), ["bad.tsv:4:", "column 'I5'", "'abc'",
                                                                             "expected a number"], "not_a_number"),
    "not_utf8": (2, None, ["bad.tsv:2:", "column 'C3'", "expected UTF-8 text"], "not_utf8"),
    "label": (5, _criteo_line(label="7"), ["bad.tsv:5:", "column 'label'", "'7'", "expected 0 or 1"], "label_not_0_1"),
}


def _bad_file(tmp_path, case: str, rows: int = 50):
    line, replacement, _, _ = BAD_CASES[case]
    lines = [_criteo_line(label=str(i % 2)).encode() for i in range(rows)]
    if case == "not_utf8":
        cats = [b"68fd1e64"] * 26
        cats[2] = b"\xff\xfe\x00x"
        lines[line - 1] = b"\t".join([b"1", *[b"1"] * 13, *cats])
    else:
        lines[line - 1] = replacement.encode()
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_error_names_file_line_column_and_value(tmp_path, case):
    path = _bad_file(tmp_path, case)
    with pytest.raises(BadInputError) as err:
        preprocess([path], builtin_layout("criteo", PreprocessConfig(block_size=1 << 10)), tmp_path / "s")
    for fragment in BAD_CASES[case][2]:
        assert fragment in str(err.value), str(err.value)
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob("s.tmp-*"))


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_skip_policy_counts(tmp_path, case):
    path = _bad_file(tmp_path, case)
    store = preprocess([path], builtin_layout("criteo", PreprocessConfig(bad_rows="skip", split=SplitConfig(valid=0, test=0))),
                       tmp_path / "s")
    skipped = store.meta["skipped_rows"]
    assert skipped[BAD_CASES[case][3]] == 1 and sum(skipped.values()) == 1
    assert store.meta["splits"]["train"] == 49


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_short_row_that_is_not_utf8_is_refused_with_its_line(tmp_path, policy):
    """pyarrow decodes a bad row's text before it hands it over and cannot raise that failure (the Hypothesis
    fuzz test once met such a row): the reader refuses it with its line under either policy."""
    lines = [_criteo_line(label=str(i % 2)).encode() for i in range(50)]
    lines[6] = b"1\t\xff\xfe\t3"
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(BadInputError, match="bad.tsv:7: 3 columns, expected 40"):
        preprocess([path], builtin_layout("criteo", PreprocessConfig(bad_rows=policy)), tmp_path / "s")


def test_line_numbers_are_exact_across_blocks_and_files(tmp_path):
    good = tmp_path / "good.tsv"
    good.write_text("\n".join(_criteo_line() for _ in range(300)) + "\n")
    lines = [_criteo_line() for _ in range(400)]
    lines[336] = _criteo_line(dense=["1"] * 12 + ["x7"])
    bad = tmp_path / "second.tsv"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInputError, match=r"second\.tsv:337: column 'I13' has 'x7'"):
        preprocess([good, bad], builtin_layout("criteo", PreprocessConfig(block_size=4096)), tmp_path / "s")
    lines[336] = "1\t2"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInputError, match=r"second\.tsv:337: 2 columns, expected 40"):
        preprocess([good, bad], builtin_layout("criteo", PreprocessConfig(block_size=4096)), tmp_path / "s")


def test_gzip_input_matches_plain(tmp_path):
    import gzip

    dac = shared_file("criteo_sample/dac_sample.tsv")
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(dac.read_bytes()))
    cfg = PreprocessConfig(split=SplitConfig(valid=0, test=0))
    a, b = preprocess([dac], builtin_layout("criteo", cfg), tmp_path / "a"), preprocess([gz], builtin_layout("criteo", cfg), tmp_path / "b")
    np.testing.assert_array_equal(a.split("train").sparse, b.split("train").sparse)


def test_header_missing_columns_is_refused(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("label,user,item\n1,2,3\n")
    with pytest.raises(BadInputError, match=r"f\.csv:1: the header lacks columns 'daytime', .*the file has \['label', 'user', 'item'\]"):
        preprocess([path], builtin_layout("frappe", PreprocessConfig()), tmp_path / "s")


def key_of(b: bytes) -> int:
    """Pure-Python reference of pipeline.data.hashing.bytes_keys (splitmix64 over 8-byte words)."""
    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) % (1 << 64)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
        return z ^ (z >> 31)

    h = mix(len(b))
    for k in range(0, len(b), 8):
        h = mix(h ^ int.from_bytes(b[k:k + 8].ljust(8, b"\0"), "little"))
    return h or 1


@pytest.mark.parametrize("values", [
    ["68fd1e64", None, "0b153874", "68fd1e64"],                 # fixed width with missing
    ["a", "", "hello world, longer than 16", None, "12345678", "123456789"],  # variable widths
])
def test_string_keys_match_python_reference(values):
    import pyarrow as pa

    from pipeline.data.hashing import string_keys

    got = string_keys(pa.array(values, pa.string()))
    want = [0 if v is None else key_of(v.encode()) for v in values]
    assert got.tolist() == want


@pytest.mark.parametrize("values", [
    ["68fd1e64", None, "0b153874", "68fd1e64", None],            # width 8 with missing: raw words
    ["0b153874", "68fd1e64", "0b153874"],                        # width 8, none missing
    ["abc", "abd", None, "abc"],                                 # width 3: padded words
    ["a", "", "hello world, longer than 16", None, "a"],          # variable widths: every value hashed
    [None, None],
])
def test_factorized_keys_match_python_reference(values):
    import pyarrow as pa

    from pipeline.data.hashing import factorized_string_keys

    codes, distinct = factorized_string_keys(pa.array(values, pa.string()))
    keys = [0 if v is None else key_of(v.encode()) for v in values]
    want_distinct = list(dict.fromkeys(keys))  # first appearance order
    assert distinct.tolist() == want_distinct
    assert codes.dtype == np.int32 and codes.tolist() == [want_distinct.index(k) for k in keys]


def test_chunked_reading_keeps_earlier_tables_intact():
    import pyarrow as pa

    from pipeline.data.reader import RawReader

    dac = shared_file("criteo_sample/dac_sample.tsv")
    small = list(RawReader([dac], CRITEO, block_size=1 << 16))  # the chunk buffer is reused 29 times
    whole = list(RawReader([dac], CRITEO, block_size=1 << 26))
    assert len(small) > 10 and pa.concat_tables(small).equals(pa.concat_tables(whole))


@pytest.mark.parametrize("categorical", ["vocab", "raw"])
def test_a_declared_time_column_is_kept_as_seconds_since_1970(tmp_path, categorical):
    """``data.time``: Avazu's ``hour`` (YYMMDDHH) kept per row in file order, against Python's own calendar; both
    preprocessing paths (two passes through the spill, and one)."""
    frame = pd.read_csv(shared_file("avazu_sample/avazu_sample.csv"), dtype=str)
    rows = np.arange(len(frame))
    frame["hour"] = [f"1410{21 + d:02d}{h:02d}" for d, h in zip(rows * 7 % 9, rows * 5 % 24)]  # other times a row
    path = tmp_path / "avazu.csv"
    frame.to_csv(path, index=False)
    data = builtin_layout("avazu", PreprocessConfig(categorical=categorical, split=SplitConfig(valid=0.0, test=0.0)))
    data.time, data.time_format = "hour", "%y%m%d%H"
    store = preprocess([path], data, tmp_path / "a")
    hour = frame["hour"].astype(int)
    expected = [int(datetime.datetime(2000 + h // 1_000_000, h // 10_000 % 100, h // 100 % 100, h % 100,
                                      tzinfo=datetime.timezone.utc).timestamp()) for h in hour]
    assert store.meta["time"] == "hour"
    np.testing.assert_array_equal(store.split("train").time, expected)
    assert store.split("train").time.dtype == np.int64 and len(set(expected)) == 72  # (7i mod 9, 5i mod 24) repeats every 72 rows


@pytest.mark.parametrize("bad, expected", [("14102100x", r"'14102100x'; expected a time in the format '%y%m%d%H'"),
                                           ("", r"column 'hour' is empty; expected a time")])
def test_a_bad_or_missing_time_is_refused_with_its_line(tmp_path, bad, expected):
    lines = shared_file("avazu_sample/avazu_sample.csv").read_text().splitlines()
    cells = lines[7].split(",")
    cells[lines[0].split(",").index("hour")] = bad
    lines[7] = ",".join(cells)
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    data = builtin_layout("avazu", PreprocessConfig(categorical="raw", block_size=1 << 12))
    data.time, data.time_format = "hour", "%y%m%d%H"
    with pytest.raises(BadInputError, match=r"bad\.csv:8: (column 'hour' has )?" + expected):
        preprocess([path], data, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_a_time_column_that_cannot_be_one_is_refused():
    from pipeline.data.dataset import DataConfig, FeatureDecl

    def declare(time: str, **kw) -> DataConfig:
        return DataConfig(name="mylog", format="csv", header=True, label="clicked", time=time,
                          features=[FeatureDecl(name="price", type="numeric"), FeatureDecl(name="user")], **kw)

    assert declare("click_time").text_columns == ("user", "click_time")
    for time in ("clicked", "price"):
        with pytest.raises(ValueError, match=rf"time='{time}': expected a text column of times"):
            declare(time)
    with pytest.raises(ValueError, match=r"time='when': .*\(columns: \['clicked', 'price', 'user'\]\)"):
        DataConfig(name="mylog", format="csv", columns=["clicked", "price", "user"], label="clicked", time="when",
                   features=[FeatureDecl(name="price", type="numeric"), FeatureDecl(name="user")])
