"""Streaming two-pass preprocessing of raw CTR files into a :mod:`pipeline.data.store`.

Pass 1 reads the files in blocks (pyarrow's multi-threaded CSV reader), assigns every row to a
split and counts categorical values over the *training* rows only. Pass 2 reads again and encodes:

* categorical: vocabulary = values with training count >= ``min_count``, most frequent first,
  ids 2..; missing → 1; anything else (rare, or unseen in training) → 0 (OOV);
* dense: ``log1p(max(x, 0))``, missing → 0;
* split: a row's split is a pure function of (split seed, global row number) — ``random`` — or of
  its position — ``sequential`` (the last ``test`` and, before it, ``valid`` fractions of rows).

Memory is bounded by the vocabularies and one block, not by the file size.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.data.hashing import hash_keys, to_unit
from pipeline.data.schema import Schema
from pipeline.data.store import FIRST_VOCAB_ID, MISSING_ID, OOV_ID, SPLITS, ColumnarStore, StoreWriter

SPLIT_CODES = {name: i for i, name in enumerate(SPLITS)}


@dataclass(frozen=True)
class SplitConfig:
    method: str = "random"  # random | sequential
    valid: float = 0.05
    test: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("random", "sequential"):
            raise ValueError(f"split.method={self.method!r}: expected 'random' or 'sequential'")
        if not (0 <= self.valid < 1 and 0 <= self.test < 1 and self.valid + self.test < 1):
            raise ValueError(f"split fractions valid={self.valid}, test={self.test}: each in [0, 1), sum < 1")


@dataclass(frozen=True)
class PreprocessConfig:
    min_count: int = 2
    split: SplitConfig = field(default_factory=SplitConfig)
    block_size: int = 32 << 20  # bytes of text per parsed block

    @classmethod
    def from_mapping(cls, m: dict) -> "PreprocessConfig":
        m = dict(m)
        split = SplitConfig(**m.pop("split", {}))
        return cls(split=split, **m)


class _ProgressFile(io.RawIOBase):
    """Binary file wrapper that reports bytes read to a tqdm bar."""

    def __init__(self, path: Path, bar: tqdm) -> None:
        self._f = open(path, "rb")
        self._bar = bar

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self._f.readinto(b)
        self._bar.update(n or 0)
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def read_blocks(files: Sequence[Path], schema: Schema, block_size: int, desc: str) -> Iterator[pa.RecordBatch]:
    """Stream record batches with the schema's column types from one or more raw files."""
    total = sum(os.path.getsize(f) for f in files)
    types = schema.arrow_schema()
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False) as bar:
        for path in files:
            if os.path.getsize(path) == 0:
                raise ValueError(f"{path}: the file is empty (expected {schema.name}-format rows)")
            src = _ProgressFile(Path(path), bar)
            try:
                reader = pacsv.open_csv(
                    pa.PythonFile(src, mode="r"),
                    read_options=pacsv.ReadOptions(
                        column_names=None if schema.header else list(schema.columns),
                        block_size=block_size,
                        use_threads=True,
                    ),
                    parse_options=pacsv.ParseOptions(delimiter=schema.delimiter, quote_char=False),
                    convert_options=pacsv.ConvertOptions(
                        column_types={f.name: f.type for f in types},
                        include_columns=[f.name for f in types],
                        strings_can_be_null=True,
                    ),
                )
                yield from reader
            finally:
                src.close()


def assign_splits(row_index: np.ndarray, total_rows: int, cfg: SplitConfig) -> np.ndarray:
    """Split code (0 train, 1 valid, 2 test) of each global row number."""
    if cfg.method == "random":
        u = to_unit(hash_keys(cfg.seed, row_index))
    else:
        u = 1.0 - (row_index.astype(np.float64) + 0.5) / total_rows
    codes = np.zeros(len(row_index), dtype=np.int8)
    codes[u < cfg.valid + cfg.test] = SPLIT_CODES["valid"]
    codes[u < cfg.test] = SPLIT_CODES["test"]
    return codes


def _count_values(column: pa.Array) -> pa.Table:
    vc = pc.value_counts(column)
    t = pa.table({"value": vc.field("values"), "count": vc.field("counts")})
    return t.filter(pc.is_valid(t["value"]))


def _merge_counts(tables: list[pa.Table]) -> pa.Table:
    merged = pa.concat_tables(tables).group_by("value").aggregate([("count", "sum")])
    return merged.rename_columns(["value", "count"])


def _count_rows(files: Sequence[Path], schema: Schema) -> int:
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                n += chunk.count(b"\n")
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                n += fh.read(1) != b"\n"
        n -= int(schema.header)
    return n


def encode_categorical(column: pa.Array, vocab: pa.Array) -> np.ndarray:
    """Map raw values to table ids: vocabulary position + 2, missing → 1, OOV → 0."""
    idx = pc.index_in(column, value_set=vocab)
    out = idx.fill_null(-FIRST_VOCAB_ID + OOV_ID).to_numpy(zero_copy_only=False).astype(np.int32) + FIRST_VOCAB_ID
    if column.null_count:
        out[column.is_null().to_numpy(zero_copy_only=False)] = MISSING_ID
    return out


def transform_dense(column: pa.Array) -> np.ndarray:
    """log1p(max(x, 0)); missing → 0."""
    x = column.to_numpy(zero_copy_only=False).astype(np.float64)
    return np.nan_to_num(np.log1p(np.maximum(x, 0.0)), nan=0.0).astype(np.float32)


def _field_stats(counts: pa.Table, kept: int, min_count: int) -> dict:
    c = np.sort(counts["count"].to_numpy())[::-1] if counts.num_rows else np.zeros(0, dtype=np.int64)
    total = int(c.sum())
    top = max(1, int(np.ceil(0.01 * len(c)))) if len(c) else 0
    edges = [1, 2, 5, 10, 100, 1000, 10_000, 100_000]
    hist = np.histogram(c, bins=edges + [np.inf])[0] if len(c) else np.zeros(len(edges), dtype=np.int64)
    return {
        "distinct_train": int(len(c)),
        "kept": int(kept),
        "occurrences_train": total,
        "kept_share": float(c[:kept].sum() / total) if total else 0.0,
        "top1pct_share": float(c[:top].sum() / total) if total else 0.0,
        "count_histogram": {"edges": edges, "ids": [int(h) for h in hist]},
        "min_count": min_count,
    }


def preprocess(files: Sequence[str | os.PathLike], schema: Schema, cfg: PreprocessConfig,
               out_dir: str | os.PathLike, provenance: dict | None = None) -> ColumnarStore:
    """Build the store for ``files`` at ``out_dir`` (atomically; see :class:`StoreWriter`)."""
    files = [Path(f) for f in files]
    t0 = time.perf_counter()
    total_rows = _count_rows(files, schema) if cfg.split.method == "sequential" else -1

    # Pass 1: split assignment, split sizes, training value counts.
    split_rows = dict.fromkeys(SPLITS, 0)
    pending: dict[str, list[pa.Table]] = {c: [] for c in schema.categorical}
    counts: dict[str, pa.Table] = {}
    row0 = 0
    for batch in read_blocks(files, schema, cfg.block_size, "preprocess pass 1/2"):
        n = batch.num_rows
        codes = assign_splits(np.arange(row0, row0 + n, dtype=np.uint64), total_rows, cfg.split)
        row0 += n
        for name, code in SPLIT_CODES.items():
            split_rows[name] += int((codes == code).sum())
        train = pa.array(codes == SPLIT_CODES["train"])
        for c in schema.categorical:
            pending[c].append(_count_values(batch.column(c).filter(train)))
            if len(pending[c]) >= 8:
                pending[c] = [_merge_counts(pending[c] + ([counts[c]] if c in counts else []))]
                counts[c] = pending[c].pop()
    if row0 == 0:
        raise ValueError(f"{', '.join(map(str, files))}: no rows to preprocess (empty input)")
    for c in schema.categorical:
        counts[c] = _merge_counts(pending[c] + ([counts[c]] if c in counts else []))

    vocab: dict[str, pa.Array] = {}
    stats: dict[str, dict] = {}
    for c in schema.categorical:
        kept = counts[c].filter(pc.greater_equal(counts[c]["count"], cfg.min_count))
        kept = kept.sort_by([("count", "descending"), ("value", "ascending")])
        vocab[c] = kept["value"].combine_chunks()
        stats[c] = _field_stats(counts[c], kept.num_rows, cfg.min_count)
        counts[c] = kept

    # Pass 2: encode and write.
    writer = StoreWriter(out_dir, split_rows, len(schema.dense), len(schema.categorical))
    try:
        for c in schema.categorical:
            pq.write_table(counts[c], writer.vocab_dir / f"{c}.parquet")
        row0 = 0
        positives = dict.fromkeys(SPLITS, 0)
        for batch in read_blocks(files, schema, cfg.block_size, "preprocess pass 2/2"):
            n = batch.num_rows
            codes = assign_splits(np.arange(row0, row0 + n, dtype=np.uint64), total_rows, cfg.split)
            row0 += n
            label = batch.column(schema.label).to_numpy(zero_copy_only=False).astype(np.int8)
            dense = np.stack([transform_dense(batch.column(c)) for c in schema.dense], axis=1) \
                if schema.dense else np.zeros((n, 0), np.float32)
            sparse = np.stack([encode_categorical(batch.column(c), vocab[c]) for c in schema.categorical], axis=1)
            for name, code in SPLIT_CODES.items():
                m = codes == code
                if m.any():
                    writer.append(name, label[m], dense[m], sparse[m])
                    positives[name] += int(label[m].sum())
        meta = {
            "schema": schema.name,
            "dense": list(schema.dense),
            "categorical": list(schema.categorical),
            "table_sizes": {c: int(len(vocab[c]) + FIRST_VOCAB_ID) for c in schema.categorical},
            "splits": split_rows,
            "positive_rate": {k: positives[k] / split_rows[k] if split_rows[k] else None for k in SPLITS},
            "stats": stats,
            "preprocess": asdict(cfg),
            "provenance": provenance or {},
            "seconds": time.perf_counter() - t0,
        }
        return writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
