"""Streaming two-pass preprocessing of raw CTR files into a :mod:`pipeline.data.store`.

Pass 1 parses the files once, in blocks (:class:`pipeline.data.reader.RawReader`): it assigns every
row to a split, turns every categorical value into a 64-bit key (:func:`pipeline.data.hashing.bytes_keys` of
its UTF-8 bytes; 0 = missing) and factorizes each field's keys within the block (hash-based: the
block's distinct keys plus a 32-bit code per row; :func:`pipeline.data.hashing.factorized_string_keys`
factorizes fixed-width values of up to 8 bytes by their raw bytes and hashes only the distinct
ones). It spills split code, label, raw dense values, codes and distinct keys to scratch files
(ordinary writes) and gathers training statistics: key counts (or hashed-bucket counts) and, for
min-max scaling, each dense column's range. Pass 2 reads the scratch files back in chunks (no
re-parsing), looks up only each block's distinct keys in the vocabulary, gathers the ids by code,
and writes the store:

* categorical, ``vocab``: values with training count >= ``min_count``, most frequent first (ties by
  key), get ids 2..; missing → 1; anything else (rare, or unseen in training) → 0 (OOV);
* categorical, ``hash``: ``2 + key mod buckets`` (no vocabulary); missing → 1;
* dense: ``log1p(max(x, 0))`` or min-max ``(x - min) / (max - min)`` clipped to [0, 1]; missing → 0;
* split: ``random`` — a pure function of (seed, row number); ``sequential`` — the last ``test``
  and, before it, the last ``valid`` fractions of the rows; ``given`` — by file (``path`` is a
  mapping split → files).

Memory is bounded by the vocabularies and one block, not by the file size. Keys identify values
(a 64-bit collision among 10^7 distinct values of a field has probability ~3·10^-6); the
vocabulary file lists each kept key with its count, so new data is encoded by hashing its values.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.data.hashing import factorized_string_keys, hash_keys, to_unit
from pipeline.data.prefetch import prefetch
from pipeline.data.reader import RawReader, open_lines
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
    with open_lines(path) as fh:
        while chunk := fh.read(1 << 24):
            n += chunk.count(b"\n")
    return n


def _merge_counts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum the counts of equal keys over several (sorted unique keys, counts) pairs."""
    if len(parts) == 1:
        return parts[0]
    keys, inverse = np.unique(np.concatenate([k for k, _ in parts]), return_inverse=True)
    return keys, np.bincount(inverse, weights=np.concatenate([c for _, c in parts])).astype(np.int64)


def train_counts(codes: np.ndarray, distinct: np.ndarray, train: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Non-missing keys seen in training rows (``train`` mask; None = all) and their counts."""
    c = np.bincount(codes if train is None else codes[train], minlength=len(distinct))
    seen = (c > 0) & (distinct != 0)
    return distinct[seen], c[seen].astype(np.int64)


def transform_dense(x: np.ndarray, cfg: PreprocessConfig, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[n, d] raw float32 values (NaN = missing) → float32 features (missing → 0). Works in place."""
    y = np.asarray(x, dtype=np.float32)
    if cfg.dense_transform == "log1p":
        # log(1 + x) is log1p(x) to float32 rounding for the integer counts read here (dense columns
        # are integer columns) and, unlike log1p, vectorised: 5x faster
        np.maximum(y, 0.0, out=y)
        y += 1.0
        np.log(y, out=y)
    else:
        lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
        span = np.where(hi32 > lo32, hi32 - lo32, np.float32(1.0))
        y -= lo32
        y /= span
        np.clip(y, 0.0, 1.0, out=y)
        y[:, ~(hi32 > lo32)] = 0.0
    return np.nan_to_num(y, copy=False, nan=0.0)


COVERAGE_LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99)


def _field_stats(counts: np.ndarray, kept: int) -> dict:
    """Cardinality, count histogram, top-1 % share and ``coverage_rows``: how many of the most
    frequent ids carry each share of the occurrences (what an embedding cache must hold)."""
    c = np.sort(counts)[::-1]
    total = int(c.sum())
    top = max(1, int(np.ceil(0.01 * len(c)))) if len(c) else 0
    cum = np.cumsum(c)
    coverage = {str(q): int(np.searchsorted(cum, q * total) + 1) if total else 0 for q in COVERAGE_LEVELS}
    edges = [1, 2, 5, 10, 100, 1000, 10_000, 100_000]
    hist = np.histogram(c, bins=edges + [np.inf])[0] if len(c) else np.zeros(len(edges), dtype=np.int64)
    return {
        "distinct_train": int(len(c)),
        "kept": int(kept),
        "occurrences_train": total,
        "kept_share": float(c[:kept].sum() / total) if total else 0.0,
        "top1pct_share": float(c[:top].sum() / total) if total else 0.0,
        "count_histogram": {"edges": edges, "ids": [int(h) for h in hist]},
        "coverage_rows": coverage,
    }


class _Spill:
    """Pass-1 blocks on disk: split code, label, raw dense values (NaN = missing), each field's
    per-row codes (field-major, [fields, rows]) and each field's distinct keys (concatenated)."""

    SPECS = {"split": np.int8, "label": np.int8, "dense": np.float32, "codes": np.int32, "distinct": np.uint64}

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.blocks: list[tuple[int, int, tuple[int, ...]]] = []  # rows, dense width, distinct keys per field
        self.handles = {name: open(folder / f"{name}.bin", "wb") for name in self.SPECS}

    @property
    def rows(self) -> int:
        return sum(b[0] for b in self.blocks)

    def append(self, split: np.ndarray, label: np.ndarray, dense: np.ndarray, codes: np.ndarray,
               distinct: list[np.ndarray]) -> None:
        arrays = {"split": split, "label": label, "dense": dense, "codes": codes,
                  "distinct": np.concatenate(distinct) if distinct else np.zeros(0, np.uint64)}
        for name, a in arrays.items():
            np.ascontiguousarray(a, dtype=self.SPECS[name]).tofile(self.handles[name])
        self.blocks.append((len(split), dense.shape[1], tuple(len(d) for d in distinct)))

    def read(self) -> Iterator[dict[str, Any]]:
        for fh in self.handles.values():
            fh.close()
        readers = {name: open(self.folder / f"{name}.bin", "rb") for name in self.SPECS}

        def take(name: str, count: int) -> np.ndarray:
            return np.fromfile(readers[name], dtype=self.SPECS[name], count=count)

        try:
            for n, width, sizes in self.blocks:
                distinct = take("distinct", sum(sizes))
                yield {"split": take("split", n), "label": take("label", n),
                       "dense": take("dense", n * width).reshape(n, width),
                       "codes": take("codes", n * len(sizes)).reshape(len(sizes), n),
                       "distinct": np.split(distinct, np.cumsum(sizes)[:-1]) if sizes else []}
        finally:
            for fh in readers.values():
                fh.close()


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


def _dense_raw(table: pa.Table, schema: Schema) -> np.ndarray:
    if not schema.dense:
        return np.zeros((table.num_rows, 0), np.float32)
    return np.stack([table.column(c).to_numpy().astype(np.float32) for c in schema.dense], axis=1)


def preprocess(files: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]], schema: Schema,
               cfg: PreprocessConfig, out_dir: str | os.PathLike, provenance: dict | None = None) -> ColumnarStore:
    """Build the store for ``files`` at ``out_dir`` (atomically; see :class:`StoreWriter`)."""
    sources = sources_from(files)
    if (cfg.split.method == "given") != all(split is not None for _, split in sources):
        raise ValueError("preprocess.split.method='given' needs data.path as a mapping split → files (and only then)")
    t0 = time.perf_counter()
    total_rows = sum(_count_lines(p) - int(schema.header) for p, _ in sources) if cfg.split.method == "sequential" else -1
    hashed = cfg.categorical == "hash"
    n_cat, n_dense = len(schema.categorical), len(schema.dense)
    writer: StoreWriter | None = None
    scratch = Path(out_dir).with_name(Path(out_dir).name + f".scratch-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(max_workers=max(1, min(n_cat, os.cpu_count() or 1)))
    try:
        # Pass 1: parse once; spill rows; split sizes and training statistics.
        spill = _Spill(scratch)
        split_rows = dict.fromkeys(SPLITS, 0)
        counts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_cat)]
        bucket_counts = np.zeros((n_cat, cfg.hash_buckets), np.int64) if hashed else None
        lo, hi = np.full(n_dense, np.inf), np.full(n_dense, -np.inf)
        first = _Pass(sources, schema, cfg, total_rows, "preprocess pass 1/2")
        for table, split in prefetch(first):
            codes = np.empty((n_cat, table.num_rows), np.int32)
            train = split == SPLIT_CODES["train"]
            train_rows = None if train.all() else train

            def field_keys(j: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
                codes[j], distinct = factorized_string_keys(table.column(schema.categorical[j]))
                k, c = train_counts(codes[j], distinct, train_rows)
                if hashed:
                    bucket_counts[j] += np.bincount((k % np.uint64(cfg.hash_buckets)).astype(np.int64), weights=c,
                                                    minlength=cfg.hash_buckets).astype(np.int64)
                return distinct, (k, c)

            per_field = list(pool.map(field_keys, range(n_cat)))
            dense = _dense_raw(table, schema)
            label = table.column(schema.label).to_numpy().astype(np.int8)
            spill.append(split, label, dense, codes, [d for d, _ in per_field])
            for name, code in SPLIT_CODES.items():
                split_rows[name] += int(np.count_nonzero(split == code))
            if n_dense and cfg.dense_transform == "minmax" and train.any():
                with warnings.catch_warnings():  # a column may be all missing in a block
                    warnings.simplefilter("ignore", RuntimeWarning)
                    lo = np.fmin(lo, np.nanmin(dense[train], axis=0))
                    hi = np.fmax(hi, np.nanmax(dense[train], axis=0))
            if hashed:
                continue
            for j, (_, kc) in enumerate(per_field):
                counts[j].append(kc)
                if len(counts[j]) >= 8:
                    counts[j] = [_merge_counts(counts[j])]
        if spill.rows == 0:
            raise ValueError(f"{', '.join(str(p) for p, _ in sources)}: no usable rows to preprocess")

        vocab_keys: list[np.ndarray] = []
        stats: dict[str, dict] = {}
        table_sizes: dict[str, int] = {}
        vocab_tables: dict[str, pa.Table] = {}
        for j, c in enumerate(schema.categorical):
            if hashed:
                b = bucket_counts[j]
                stats[c] = _field_stats(b[b > 0], int((b > 0).sum()))
                table_sizes[c] = cfg.hash_buckets + FIRST_VOCAB_ID
                continue
            k, n = _merge_counts(counts[j]) if counts[j] else (np.zeros(0, np.uint64), np.zeros(0, np.int64))
            keep = n >= cfg.min_count
            order = np.lexsort((k[keep], -n[keep]))
            kept_keys, kept_counts = k[keep][order], n[keep][order]
            vocab_keys.append(kept_keys)
            vocab_tables[c] = pa.table({"key": pa.array(kept_keys, pa.uint64()), "count": kept_counts})
            stats[c] = _field_stats(n, len(kept_keys))
            table_sizes[c] = len(kept_keys) + FIRST_VOCAB_ID
        lo, hi = np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 0.0)

        # Pass 2: encode the spilled rows and write the store.
        writer = StoreWriter(out_dir, split_rows, n_dense, n_cat)
        for c, t in vocab_tables.items():
            pq.write_table(t, writer.vocab_dir / f"{c}.parquet")
        # a pandas Index keeps its hash table between lookups (pc.index_in would rebuild it per chunk)
        vocab_index = [pd.Index(v, dtype=np.uint64) for v in vocab_keys]
        positives = dict.fromkeys(SPLITS, 0)

        def encode(j: int, chunk: dict[str, Any], order: np.ndarray, out: np.ndarray) -> None:
            k = chunk["distinct"][j]  # only the block's distinct keys are looked up
            if hashed:
                ids = (k % np.uint64(cfg.hash_buckets)).astype(np.int32) + FIRST_VOCAB_ID
            else:
                pos = vocab_index[j].get_indexer(k)  # -1 where not in the vocabulary
                ids = np.where(pos >= 0, pos + FIRST_VOCAB_ID, OOV_ID).astype(np.int32)
            ids[k == 0] = MISSING_ID
            out[j] = ids[chunk["codes"][j][order]]

        for chunk in prefetch(spill.read()):
            # rows grouped by split (file order kept inside each): every split's rows are one slice
            order = np.argsort(chunk["split"], kind="stable")
            bounds = np.searchsorted(chunk["split"][order], np.arange(len(SPLITS) + 1))
            label = chunk["label"][order]
            dense = transform_dense(chunk["dense"][order], cfg, lo, hi)
            sparse = np.empty((n_cat, len(order)), np.int32)  # field-major: each field's ids written contiguously
            list(pool.map(lambda j: encode(j, chunk, order, sparse), range(n_cat)))
            for name, code in SPLIT_CODES.items():
                rows = slice(bounds[code], bounds[code + 1])
                if rows.stop > rows.start:
                    writer.append(name, label[rows], dense[rows], sparse[:, rows].T)
                    positives[name] += int(label[rows].sum())
        meta = {
            "schema": schema.name,
            "dense": list(schema.dense),
            "categorical": list(schema.categorical),
            "table_sizes": table_sizes,
            "splits": split_rows,
            "positive_rate": {k: positives[k] / split_rows[k] if split_rows[k] else None for k in SPLITS},
            **({"dense_range": {c: [float(lo[j]), float(hi[j])] for j, c in enumerate(schema.dense)}}
               if cfg.dense_transform == "minmax" else {}),
            "skipped_rows": first.skipped(),
            "stats": stats,
            "preprocess": asdict(cfg),
            "provenance": provenance or {},
            "seconds": time.perf_counter() - t0,
        }
        return writer.commit(meta)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        pool.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
