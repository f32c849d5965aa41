"""Streaming two-pass preprocessing of raw CTR files into a :mod:`pipeline.data.store`.

Pass 1 reads the files in blocks (:class:`pipeline.data.reader.RawReader`), assigns every row to a
split, and gathers training statistics: categorical value counts (or hashed-bucket counts) and,
for min-max scaling, each dense column's range. Pass 2 reads again, encodes and writes:

* categorical, ``vocab``: values with training count >= ``min_count``, most frequent first, get
  ids 2..; missing → 1; anything else (rare, or unseen in training) → 0 (OOV);
* categorical, ``hash``: ``2 + FNV-1a(value) mod buckets`` (no vocabulary); missing → 1;
* dense: ``log1p(max(x, 0))`` or min-max ``(x - min) / (max - min)`` clipped to [0, 1]; missing → 0;
* split: ``random`` — a pure function of (seed, row number); ``sequential`` — the last ``test``
  and, before it, the last ``valid`` fractions of the rows; ``given`` — by file (``path`` is a
  mapping split → files).

Memory is bounded by the vocabularies and one block, not by the file size.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.data.hashing import fnv1a64_strings, hash_keys, to_unit
from pipeline.data.reader import RawReader
from pipeline.data.schema import Schema
from pipeline.data.store import FIRST_VOCAB_ID, MISSING_ID, OOV_ID, SPLITS, ColumnarStore, StoreWriter

SPLIT_CODES = {name: i for i, name in enumerate(SPLITS)}
SPLIT_METHODS = ("random", "sequential", "given")


@dataclass(frozen=True)
class SplitConfig:
    method: str = "random"
    valid: float = 0.05
    test: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPLIT_METHODS:
            raise ValueError(f"preprocess.split.method={self.method!r}: expected one of {SPLIT_METHODS}")
        if not (0 <= self.valid < 1 and 0 <= self.test < 1 and self.valid + self.test < 1):
            raise ValueError(f"preprocess.split fractions valid={self.valid}, test={self.test}: each in [0, 1), sum < 1")


@dataclass(frozen=True)
class PreprocessConfig:
    min_count: int = 2
    split: SplitConfig = field(default_factory=SplitConfig)
    categorical: str = "vocab"         # vocab | hash
    hash_buckets: int = 1 << 20        # buckets per field with categorical=hash
    dense_transform: str = "log1p"     # log1p | minmax
    bad_rows: str = "error"            # error | skip
    block_size: int = 32 << 20         # bytes of text per parsed block

    def __post_init__(self) -> None:
        if self.categorical not in ("vocab", "hash"):
            raise ValueError(f"preprocess.categorical={self.categorical!r}: expected 'vocab' or 'hash'")
        if self.dense_transform not in ("log1p", "minmax"):
            raise ValueError(f"preprocess.dense_transform={self.dense_transform!r}: expected 'log1p' or 'minmax'")
        if self.min_count < 1 or self.hash_buckets < 1:
            raise ValueError("preprocess.min_count and preprocess.hash_buckets must be >= 1")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "PreprocessConfig":
        m = dict(m)
        split = SplitConfig(**m.pop("split", {}))
        return cls(split=split, **m)


Sources = Sequence[tuple[Path, str | None]]  # (file, fixed split or None)


def sources_from(files: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]]) -> list[tuple[Path, str | None]]:
    if isinstance(files, Mapping):
        unknown = set(files) - set(SPLITS)
        if unknown:
            raise ValueError(f"data.path: unknown splits {sorted(unknown)}; expected keys among {SPLITS}")
        return [(Path(f), split) for split in SPLITS for f in (files.get(split) or [])]
    return [(Path(f), None) for f in files]


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


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            n += chunk.count(b"\n")
    return n


def _count_values(column: pa.Array) -> pa.Table:
    vc = pc.value_counts(column)
    t = pa.table({"value": vc.field("values"), "count": vc.field("counts")})
    return t.filter(pc.is_valid(t["value"]))


def _merge_counts(tables: list[pa.Table]) -> pa.Table:
    merged = pa.concat_tables(tables).group_by("value").aggregate([("count", "sum")])
    return merged.rename_columns(["value", "count"])


def hash_bucket(column: pa.Array, buckets: int) -> np.ndarray:
    """``2 + FNV-1a(value) mod buckets``; missing → 1."""
    col = pc.cast(column, pa.large_string()).combine_chunks() if isinstance(column, pa.ChunkedArray) \
        else pc.cast(column, pa.large_string())
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int64)[col.offset:col.offset + len(col) + 1]
    data = np.frombuffer(col.buffers()[2], dtype=np.uint8) if col.buffers()[2] is not None else np.zeros(0, np.uint8)
    ids = (fnv1a64_strings(offsets, data) % np.uint64(buckets)).astype(np.int64) + FIRST_VOCAB_ID
    if col.null_count:
        ids[col.is_null().to_numpy(zero_copy_only=False)] = MISSING_ID
    return ids.astype(np.int32)


def encode_categorical(column: pa.Array, vocab: pa.Array) -> np.ndarray:
    """Map raw values to table ids: vocabulary position + 2, missing → 1, OOV → 0."""
    idx = pc.index_in(column, value_set=vocab)
    out = idx.fill_null(-FIRST_VOCAB_ID + OOV_ID).to_numpy(zero_copy_only=False).astype(np.int32) + FIRST_VOCAB_ID
    if column.null_count:
        out[column.is_null().to_numpy(zero_copy_only=False)] = MISSING_ID
    return out


def _dense_values(column: pa.Array) -> np.ndarray:
    return column.to_numpy(zero_copy_only=False).astype(np.float64)  # missing → NaN


def transform_dense(x: np.ndarray, cfg: PreprocessConfig, lo: float = 0.0, hi: float = 0.0) -> np.ndarray:
    if cfg.dense_transform == "log1p":
        y = np.log1p(np.maximum(x, 0.0))
    else:
        y = np.clip((x - lo) / (hi - lo), 0.0, 1.0) if hi > lo else np.zeros_like(x)
    return np.nan_to_num(y, nan=0.0).astype(np.float32)


def _field_stats(counts: np.ndarray, kept: int, total_ids: int | None = None) -> dict:
    c = np.sort(counts)[::-1]
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
    }


class _Pass:
    """Iterates (table, split codes) over all sources; row numbers continue across files."""

    def __init__(self, sources: Sources, schema: Schema, cfg: PreprocessConfig, total_rows: int, desc: str):
        self.sources, self.schema, self.cfg, self.total_rows, self.desc = sources, schema, cfg, total_rows, desc
        self.readers: list[RawReader] = []

    def __iter__(self):
        row0 = 0
        for path, fixed in self.sources:
            reader = RawReader([path], self.schema, self.cfg.block_size, self.cfg.bad_rows, self.desc)
            self.readers.append(reader)
            for table in reader:
                n = table.num_rows
                if fixed is not None:
                    codes = np.full(n, SPLIT_CODES[fixed], dtype=np.int8)
                else:
                    codes = assign_splits(np.arange(row0, row0 + n, dtype=np.uint64), self.total_rows, self.cfg.split)
                row0 += n
                yield table, codes

    def skipped(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.readers:
            for k, v in r.skipped.as_dict().items():
                out[k] = out.get(k, 0) + v
        return out


def preprocess(files: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]], schema: Schema,
               cfg: PreprocessConfig, out_dir: str | os.PathLike, provenance: dict | None = None) -> ColumnarStore:
    """Build the store for ``files`` at ``out_dir`` (atomically; see :class:`StoreWriter`)."""
    sources = sources_from(files)
    if (cfg.split.method == "given") != all(split is not None for _, split in sources):
        raise ValueError("preprocess.split.method='given' needs data.path as a mapping split → files (and only then)")
    t0 = time.perf_counter()
    total_rows = sum(_count_lines(p) - int(schema.header) for p, _ in sources) if cfg.split.method == "sequential" else -1
    hashed = cfg.categorical == "hash"

    # Pass 1: split sizes, training statistics.
    split_rows = dict.fromkeys(SPLITS, 0)
    pending: dict[str, list[pa.Table]] = {c: [] for c in schema.categorical}
    counts: dict[str, pa.Table] = {}
    bucket_counts = {c: np.zeros(cfg.hash_buckets + FIRST_VOCAB_ID, np.int64) for c in schema.categorical} if hashed else {}
    lo = np.full(len(schema.dense), np.inf)
    hi = np.full(len(schema.dense), -np.inf)
    first = _Pass(sources, schema, cfg, total_rows, "preprocess pass 1/2")
    for table, codes in first:
        for name, code in SPLIT_CODES.items():
            split_rows[name] += int((codes == code).sum())
        train = codes == SPLIT_CODES["train"]
        mask = pa.array(train)
        for j, c in enumerate(schema.dense):
            x = _dense_values(table.column(c))[train]
            if np.isfinite(x).any():
                lo[j], hi[j] = min(lo[j], np.nanmin(x)), max(hi[j], np.nanmax(x))
        for c in schema.categorical:
            col = table.column(c).combine_chunks()
            if hashed:
                bucket_counts[c] += np.bincount(hash_bucket(col.filter(mask), cfg.hash_buckets),
                                                minlength=len(bucket_counts[c]))
                continue
            pending[c].append(_count_values(col.filter(mask)))
            if len(pending[c]) >= 8:
                counts[c] = _merge_counts(pending[c] + ([counts[c]] if c in counts else []))
                pending[c] = []
    if sum(split_rows.values()) == 0:
        raise ValueError(f"{', '.join(str(p) for p, _ in sources)}: no usable rows to preprocess")

    vocab: dict[str, pa.Array] = {}
    stats: dict[str, dict] = {}
    table_sizes: dict[str, int] = {}
    for c in schema.categorical:
        if hashed:
            b = bucket_counts[c][FIRST_VOCAB_ID:]
            stats[c] = _field_stats(b[b > 0], int((b > 0).sum()))
            table_sizes[c] = cfg.hash_buckets + FIRST_VOCAB_ID
            continue
        merged = _merge_counts(pending[c] + ([counts[c]] if c in counts else []))
        kept = merged.filter(pc.greater_equal(merged["count"], cfg.min_count))
        kept = kept.sort_by([("count", "descending"), ("value", "ascending")])
        vocab[c] = kept["value"].combine_chunks()
        stats[c] = _field_stats(merged["count"].to_numpy(), kept.num_rows)
        counts[c] = kept
        table_sizes[c] = len(vocab[c]) + FIRST_VOCAB_ID

    # Pass 2: encode and write.
    writer = StoreWriter(out_dir, split_rows, len(schema.dense), len(schema.categorical))
    try:
        if not hashed:
            for c in schema.categorical:
                pq.write_table(counts[c], writer.vocab_dir / f"{c}.parquet")
        positives = dict.fromkeys(SPLITS, 0)
        for table, codes in _Pass(sources, schema, cfg, total_rows, "preprocess pass 2/2"):
            n = table.num_rows
            label = table.column(schema.label).to_numpy(zero_copy_only=False).astype(np.int8)
            dense = np.stack([transform_dense(_dense_values(table.column(c)), cfg, lo[j], hi[j])
                              for j, c in enumerate(schema.dense)], axis=1) if schema.dense else np.zeros((n, 0), np.float32)
            sparse = np.stack([hash_bucket(table.column(c).combine_chunks(), cfg.hash_buckets) if hashed
                               else encode_categorical(table.column(c).combine_chunks(), vocab[c])
                               for c in schema.categorical], axis=1)
            for name, code in SPLIT_CODES.items():
                m = codes == code
                if m.any():
                    writer.append(name, label[m], dense[m], sparse[m])
                    positives[name] += int(label[m].sum())
        meta = {
            "schema": schema.name,
            "dense": list(schema.dense),
            "categorical": list(schema.categorical),
            "table_sizes": table_sizes,
            "splits": split_rows,
            "positive_rate": {k: positives[k] / split_rows[k] if split_rows[k] else None for k in SPLITS},
            "dense_range": {c: [float(lo[j]), float(hi[j])] for j, c in enumerate(schema.dense)},
            "skipped_rows": first.skipped(),
            "stats": stats,
            "preprocess": asdict(cfg),
            "provenance": provenance or {},
            "seconds": time.perf_counter() - t0,
        }
        return writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
