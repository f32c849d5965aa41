"""Raw rows → the store's encoding, as preprocessing does it: the declaration's readers and feature
extraction, the tables' vocabularies (unseen → OOV, missing → the missing id) or hashing, the numeric
transforms with the training ranges (:mod:`pipeline.data.encoding`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from modules.embedding import FeatureSpec
from pipeline.checkpoint.run_description import declaration_from
from pipeline.data.dataset import DataConfig
from pipeline.data.encoding import encode_ids, transform_dense
from pipeline.data.features import FeatureBlock, extract
from pipeline.data.hashing import factorized_string_keys
from pipeline.data.store import FIRST_VOCAB_ID, Ragged, SplitArrays
from pipeline.data.vocab_files import read_vocabulary, vocabulary_file
from pipeline.data.vocab_growth import VocabIndex
from pipeline.runtime.errors import BundleError


class RowEncoder:
    """Raw rows → the store's encoding: the declaration's readers and features, the tables' vocabularies
    (or hashing), the numeric transforms and training ranges of ``meta`` (a store's or a bundle's);
    ``vocab_root``: the folder whose ``vocab/`` holds the vocabularies."""

    def __init__(self, meta: dict[str, Any], data: DataConfig, vocab_root: Path) -> None:
        self.meta, self.data, self.vocab_root = meta, data, vocab_root
        self.spec = FeatureSpec.from_store_meta(meta)
        self.hash_buckets = int(meta["preprocess"]["hash_buckets"])
        hashed = meta["preprocess"]["categorical"] == "hash"
        self.index = {} if hashed else {t: self._vocabulary(t) for t in meta["table_sizes"]}
        ranges = meta.get("dense_range", {})
        self.transforms = [meta["transforms"][f] for f in self.spec.dense]
        self.lo = np.array([ranges.get(f, [0.0, 0.0])[0] for f in self.spec.dense])
        self.hi = np.array([ranges.get(f, [0.0, 0.0])[1] for f in self.spec.dense])

    def _vocabulary(self, table: str) -> VocabIndex:
        try:
            vocab = read_vocabulary(self.vocab_root, table, columns=("key",),
                                    rows=self.meta["table_sizes"][table] - FIRST_VOCAB_ID)
        except ValueError as e:
            raise BundleError(str(e)) from None
        if vocab is None:
            raise BundleError(f"{vocabulary_file(self.vocab_root, table)}: missing: the vocabulary of table "
                              f"{table!r}")
        return VocabIndex(vocab.keys)

    def reading(self, label: bool) -> DataConfig:
        """The declaration to read raw rows with (without the label column when ``label`` is False)."""
        data = declaration_from(asdict(self.data))
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
            ids.append(encode_ids(distinct, codes, self.index.get(table), self.hash_buckets))
        n_cat = len(self.spec.categorical)
        sparse = np.stack(ids[:n_cat], axis=1) if n_cat else np.zeros((block.rows, 0), np.int32)
        sequences = {f: Ragged(ids[n_cat + j], np.concatenate([[0], np.cumsum(block.lengths[n_cat + j])]))
                     for j, f in enumerate(self.spec.sequence)}
        dense = transform_dense(block.numeric, self.transforms, self.lo, self.hi)
        return SplitArrays(block.label, dense, sparse, sequences)

    def frame_block(self, frame: pd.DataFrame) -> FeatureBlock:
        """The features of a DataFrame of raw columns (as a training file holds them; no label needed)."""
        data = self.reading(label=False)
        missing = [c for c in data.read_columns if c not in frame.columns]
        if missing:
            raise BundleError(f"input lacks column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                              f"(the model reads {list(data.read_columns)}); it has {list(frame.columns)[:40]}")
        columns = {}
        for c in data.read_columns:
            values = frame[c]
            if c in data.number_columns:
                columns[c] = pa.array(pd.to_numeric(values, errors="raise"), pa.float64())
            elif values.map(lambda v: isinstance(v, (list, tuple, np.ndarray))).any():
                columns[c] = pa.array([None if v is None else [str(x) for x in v] for v in values],
                                      pa.list_(pa.string()))
            else:
                columns[c] = pa.array([None if _missing(v) else str(v) for v in values], pa.string())
        return extract(pa.table(columns), data, lambda i: f"row {i}", {})


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA or v == ""
