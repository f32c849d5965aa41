"""Raw rows → the store's encoding, as preprocessing does it: the declaration's readers and feature
extraction, the tables' vocabularies (unseen → OOV, missing → the missing id) or hashing, the numeric
transforms with the training ranges (:mod:`pipeline.data.encoding`). Raw ids (``model.zch``) are mapped to
rows read-only with the model's mapping (:func:`modules.embedding.zch.mapping.lookup_rows`; unseen → the unknown row)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from modules.embedding.sparse_arch import FeatureSpec
from modules.embedding.zch.mapping import lookup_rows
from pipeline.checkpoint.run_description import declaration_from
from pipeline.data.dataset import DataConfig, FeatureDecl
from pipeline.data.encoding import encode_ids, hashed_ids, ids_of, raw_ids, transform_dense
from pipeline.data.features import FeatureBlock, extract
from pipeline.data.hashing import factorized_string_keys, string_keys
from pipeline.data.store import FIRST_VOCAB_ID, Ragged, SplitArrays, has_raw_ids
from pipeline.data.vocab_files import read_vocabulary, vocabulary_file
from pipeline.runtime.errors import BundleError, MissingColumnsError
from pipeline.scoring.arrow_columns import arrow_numbers, category_strings, empty_as_null, python_values
from pipeline.scoring.joint_index import JointVocabIndex


Columns = Mapping[str, Sequence[Any]]  # raw column → its values, one per row
HASH_EACH_UP_TO = 1024  # categorical values of a request batch hashed one by one; more: factorized first


class RowEncoder:
    """Raw rows → the store's encoding: the declaration's readers and features, the tables' vocabularies
    (or hashing), the numeric transforms and training ranges of ``meta`` (a store's or a bundle's);
    ``vocab_root``: the folder whose ``vocab/`` holds the vocabularies."""

    def __init__(self, meta: dict[str, Any], data: DataConfig, vocab_root: Path,
                 zch: dict[str, np.ndarray] | None = None, keep_raw: bool = False) -> None:
        self.meta, self.data, self.vocab_root = meta, data, vocab_root
        self.spec = FeatureSpec.from_store_meta(meta)
        self.hash_buckets = int(meta["preprocess"]["hash_buckets"])
        self.zch = zch  # raw ids: the model.zch mapping (modules.embedding.zch.mapping.mapping_state)
        self.unseen = self.raw_values = 0  # raw ids encoded so far (missing aside), and those on the unknown row
        self.raw = has_raw_ids(meta)  # keep_raw: raw ids stay raw (a remapper maps them later: the sharded scorer)
        if self.raw and zch is None and not keep_raw:
            raise BundleError("the model reads raw ids (data.preprocess.categorical=raw) but came without its "
                              "model.zch mapping (zch.npz)")
        hashed = meta["preprocess"]["categorical"] in ("hash", "raw")
        self.joint = None if hashed else JointVocabIndex({t: self._vocabulary(t) for t in meta["table_sizes"]})
        self.index = {} if hashed else {t: self.joint.table(t) for t in meta["table_sizes"]}
        ranges = meta.get("dense_range", {})
        self.transforms = [meta["transforms"][f] for f in self.spec.dense]
        self.lo = np.array([ranges.get(f, [0.0, 0.0])[0] for f in self.spec.dense])
        self.hi = np.array([ranges.get(f, [0.0, 0.0])[1] for f in self.spec.dense])
        self._readings = {label: self._reading(label) for label in (True, False)}  # built once: OmegaConf is slow

    def _vocabulary(self, table: str) -> np.ndarray:
        try:
            vocab = read_vocabulary(self.vocab_root, table, columns=("key",),
                                    rows=self.meta["table_sizes"][table] - FIRST_VOCAB_ID)
        except ValueError as e:
            raise BundleError(str(e)) from None
        if vocab is None:
            raise BundleError(f"{vocabulary_file(self.vocab_root, table)}: missing: the vocabulary of table "
                              f"{table!r}")
        return vocab.keys

    def reading(self, label: bool) -> DataConfig:
        """The declaration to read raw rows with (without the label column when ``label`` is False)."""
        return self._readings[label]

    def _reading(self, label: bool) -> DataConfig:
        data = declaration_from(asdict(self.data))
        data.time = None  # rows are scored without their time (only training's TTL clock reads it)
        if not label:
            data.label = ""
            if data.columns:
                data.columns = [c for c in data.columns if c != self.data.label]
        return data

    def encode(self, block: FeatureBlock) -> SplitArrays:
        """Ids and transformed numbers of a block of raw features."""
        tables = [self.spec.table_of(f) for f in (*self.spec.categorical, *self.spec.sequence)]
        ids = []
        for values, table in zip(block.sparse, tables):
            codes, distinct = factorized_string_keys(values)
            ids.append(self._rows(table, encode_ids(distinct, codes, self.index.get(table), self.hash_buckets,
                                                    table if self.raw else None)))
        n_cat = len(self.spec.categorical)
        sparse = np.stack(ids[:n_cat], axis=1) if n_cat else np.zeros((block.rows, 0), np.int32)
        sequences = {f: Ragged(ids[n_cat + j], np.concatenate([[0], np.cumsum(block.lengths[n_cat + j])]))
                     for j, f in enumerate(self.spec.sequence)}
        dense = transform_dense(block.numeric, self.transforms, self.lo, self.hi)
        return SplitArrays(block.label, dense, sparse, sequences)

    def encode_columns(self, columns: Columns, rows: int) -> SplitArrays:
        """Ids and transformed numbers of ``rows`` raw rows given column by column (see :meth:`columns_block`
        for what each column may hold). Without sequence or derived features every categorical column is
        hashed in one pass and every numeric column converted in one; the result equals
        ``encode(columns_block(columns, rows))``."""
        data = self.reading(label=False)
        self._check_columns(data, columns)
        decls = data.declared()
        if any(f.type == "sequence" or f.derive for f in decls):
            return self.encode(self.columns_block(columns, rows))
        sparse, dense = self.encode_features(columns, rows, decls)
        return SplitArrays(np.zeros(rows, np.int8), dense, sparse, {})

    def encode_features(self, columns: Columns, rows: int, features: Sequence[FeatureDecl]
                        ) -> tuple[np.ndarray, np.ndarray]:
        """The ids [rows, categorical ``features``] and transformed numbers [rows, numeric ``features``] of some of
        the declared features (no sequence or derived one), in declaration order, from ``rows`` raw values of each
        of their columns: every categorical column hashed in one pass, every numeric one converted in one. A
        column's values may be a Python sequence, a numpy array or an Arrow array (read as it is, no list made)."""
        numeric = [f for f in features if f.type == "numeric"]
        categorical = [f for f in features if f.type == "categorical"]
        sources = list(dict.fromkeys(f.source for f in categorical))
        if sources:
            keys = self._keys(columns, sources, rows)
            keys = keys.reshape(len(sources), rows)[[sources.index(f.source) for f in categorical]].ravel()
        if not categorical:
            ids = np.zeros(0, np.int32)
        elif self.raw:
            ids = np.concatenate([self._rows(t, raw_ids(part, t)) for part, t in
                                  zip(keys.reshape(len(categorical), rows), (self.spec.table_of(f.name) for f in categorical))])
        elif self.joint is None:
            ids = hashed_ids(keys, self.hash_buckets)
        else:  # every feature's ids in one lookup
            tables = np.repeat([self.joint.tables[self.spec.table_of(f.name)] for f in categorical], rows)
            ids = ids_of(keys, self.joint.positions_of(keys, tables.astype(np.int16)))
        sparse = np.ascontiguousarray(ids.reshape(len(categorical), rows).T)
        at = [self.spec.dense.index(f.name) for f in numeric]
        dense = transform_dense(_number_matrix(columns, [f.source for f in numeric], rows),
                                [self.transforms[j] for j in at], self.lo[at], self.hi[at])
        return sparse, dense

    def _keys(self, columns: Columns, sources: list[str], rows: int) -> np.ndarray:
        """The hash keys of the categorical ``sources``' values, column after column."""
        if all(isinstance(columns[c], (pa.Array, pa.ChunkedArray)) for c in sources):
            parts = [category_strings(c, columns[c]) for c in sources]
            values = pa.concat_arrays([p for part in parts for p in (part.chunks if isinstance(part, pa.ChunkedArray)
                                                                     else [part])])
        else:
            try:
                values = _strings([v for c in sources for v in python_values(columns[c])])
            except _NotOneValue as e:
                raise _not_one_value(sources[e.index // rows], e.index % rows, e.value) from None
        if len(values) <= HASH_EACH_UP_TO:  # a few rows: each value hashed (factorizing first costs more)
            return string_keys(values)
        codes, distinct = factorized_string_keys(values)
        return distinct[codes]

    def _rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Table rows of encoded ids: raw ids through the model.zch mapping (if given), others as they are."""
        if self.zch is None:
            return ids
        rows, present = lookup_rows(self.zch, table, ids), ids != 0
        self.unseen += int(((rows == self.meta["table_sizes"][table] - 1) & present).sum())
        self.raw_values += int(present.sum())
        return rows

    def columns_block(self, columns: Columns, rows: int) -> FeatureBlock:
        """The features of raw rows given column by column, as a training file holds them (no label needed):
        numbers, or strings of numbers, in numeric columns (missing: null, NaN or ""); strings in the
        others (a sequence: a list of strings, or one string with the declared separator). A missing or
        unreadable column raises :class:`BundleError` naming it and what was expected."""
        data = self.reading(label=False)
        self._check_columns(data, columns)
        arrays = {c: pa.array(_numbers(c, columns[c]), pa.float64()) for c in data.number_columns}
        sequences = {f.source for f in data.declared() if f.type == "sequence"}
        arrays.update({c: _texts(c, columns[c], c in sequences) for c in data.text_columns})
        try:
            return extract(pa.table(arrays), data, lambda i: f"row {i}", {})
        except ValueError as e:  # a derivation or sequence that cannot read a value: the message names it
            raise BundleError(str(e)) from None

    def encode_frame(self, frame: pd.DataFrame) -> SplitArrays:
        """:meth:`encode_columns` of a DataFrame of raw columns."""
        return self.encode_columns(frame_columns(frame), len(frame))

    def frame_block(self, frame: pd.DataFrame) -> FeatureBlock:
        """:meth:`columns_block` of a DataFrame of raw columns."""
        return self.columns_block(frame_columns(frame), len(frame))

    @staticmethod
    def _check_columns(data: DataConfig, columns: Columns) -> None:
        missing = [c for c in data.read_columns if c not in columns]
        if missing:
            raise MissingColumnsError(f"input lacks column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                              f"(the model reads {list(data.read_columns)}); it has {list(columns)[:40]}")


def frame_columns(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """A DataFrame's columns as arrays: numbers as they are, anything else as Python objects."""
    return {str(c): s.to_numpy() if s.dtype.kind in "iufb" else s.to_numpy(dtype=object) for c, s in frame.items()}


def _number_matrix(columns: Columns, names: list[str], rows: int) -> np.ndarray:
    """[rows, len(names)] float32 of numeric columns (NaN = missing); one conversion when every value is a
    number, a numeric string or null, else column by column to name the first bad one. A value past float32's
    range (the model computes in float32; an infinity too) is refused naming column and row."""
    if not names:
        return np.zeros((rows, 0), np.float32)
    try:
        m = np.array([arrow_numbers(columns[c]) for c in names], dtype=np.float64).T
    except (ValueError, TypeError, OverflowError):  # "" (missing), pd.NA, a bad value or one past float's range
        m = np.stack([_numbers(c, columns[c]) for c in names], axis=1)
    _check_range(names, m)
    return m.astype(np.float32)


def _check_range(names: Sequence[str], m: np.ndarray) -> None:
    """Refuse a value of ``m`` [rows, len(names)] past float32's range, naming its column and row."""
    past = np.abs(m) > np.finfo(np.float32).max
    if past.any():
        row, j = (int(x) for x in np.argwhere(past)[0])
        raise BundleError(f"column {names[j]!r}, row {row}: {m[row, j]:g} is past the float32 range the model "
                          f"computes in (about ±3.4e38)")


def _numbers(column: str, values: Sequence[Any]) -> np.ndarray:
    """A numeric column as float64: numbers or numeric strings; null, NaN and "" are missing; a value past
    float32's range is refused."""
    values = arrow_numbers(values)
    if isinstance(values, np.ndarray) and values.dtype.kind in "iufb":
        out = values.astype(np.float64)
        _check_range([column], out[:, None])
        return out
    out = np.empty(len(values))
    for row, v in enumerate(values):
        try:
            out[row] = np.nan if _missing(v) else float(v)
        except (TypeError, ValueError):
            raise BundleError(f"column {column!r}, row {row}: {v!r} is not a number (the declaration says "
                              f"numeric: send a number, a string of one, or null)") from None
        except OverflowError:
            raise BundleError(f"column {column!r}, row {row}: a number of {len(str(v))} digits is past the float "
                              f"range (about 1e308)") from None
    _check_range([column], out[:, None])
    return out


def _texts(column: str, values: Sequence[Any], sequence: bool) -> pa.Array:
    """A categorical column (strings; numbers are read as their text) or a sequence column (also lists of
    strings). A list or an object where one value is declared: :class:`BundleError` naming column and row."""
    if sequence and any(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        return pa.array([None if v is None else [str(x) for x in v] if isinstance(v, (list, tuple, np.ndarray))
                         else [str(v)] for v in values], pa.list_(pa.string()))
    try:
        return _strings(values)
    except _NotOneValue as e:
        raise _not_one_value(column, e.index, e.value) from None


class _NotOneValue(ValueError):
    def __init__(self, index: int, value: Any) -> None:
        super().__init__(index)
        self.index, self.value = index, value


def _not_one_value(column: str, row: int, value: Any) -> BundleError:
    return BundleError(f"column {column!r}, row {row}: {str(value)[:60]} is not one value (the declaration reads "
                       f"a string or a number there)")


def _strings(values: Sequence[Any]) -> pa.Array:
    """Raw values as an Arrow string array: each as its text, null where missing (null, NaN, ""). Strings
    and nulls only (JSON, CSV) convert in one call; numbers and NaN value by value; a list or an object
    raises :class:`_NotOneValue` with its position."""
    try:
        strings = pa.array(values, pa.string())
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        bad = next((i for i, v in enumerate(values) if isinstance(v, (list, tuple, dict, np.ndarray))), None)
        if bad is not None:
            raise _NotOneValue(bad, values[bad]) from None
        return pa.array([None if _missing(v) else str(v) for v in values], pa.string())
    return empty_as_null(strings)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA or v == ""
