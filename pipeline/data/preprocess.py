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
import pyarrow.parquet as pq

from pipeline.data.hashing import factorized_string_keys, hash_keys, to_unit
from pipeline.data.prefetch import prefetch
from pipeline.data.reader import BadInputError, RawReader, open_lines
from pipeline.data.schema import Schema
from pipeline.data.store import FIRST_VOCAB_ID, MISSING_ID, OOV_ID, SPLITS, ColumnarStore, StoreWriter
from pipeline.errors import DiskFullError, disk_full, ensure_space

SPLIT_CODES = {name: i for i, name in enumerate(SPLITS)}
SPLIT_METHODS = ("random", "sequential", "given")


@dataclass
class SplitConfig:
    method: str = "random"
    valid: float = 0.05
    test: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPLIT_METHODS:
            raise ValueError(f"method={self.method!r}: expected one of {SPLIT_METHODS}")
        if not (0 <= self.valid < 1 and 0 <= self.test < 1 and self.valid + self.test < 1):
            raise ValueError(f"valid={self.valid}, test={self.test}: expected fractions in [0, 1) with a sum < 1")


@dataclass
class PreprocessConfig:
    """``data.preprocess``."""

    min_count: int = 2
    split: SplitConfig = field(default_factory=SplitConfig)
    categorical: str = "vocab"         # vocab | hash
    hash_buckets: int = 1 << 20        # buckets per field with categorical=hash
    dense_transform: str = "log1p"     # log1p | minmax
    bad_rows: str = "error"            # error | skip
    block_size: int = 32 << 20         # bytes of text per parsed block

    def __post_init__(self) -> None:
        if self.categorical not in ("vocab", "hash"):
            raise ValueError(f"categorical={self.categorical!r}: expected 'vocab' or 'hash'")
        if self.dense_transform not in ("log1p", "minmax"):
            raise ValueError(f"dense_transform={self.dense_transform!r}: expected 'log1p' or 'minmax'")
        if self.bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows={self.bad_rows!r}: expected 'error' or 'skip'")
        if self.min_count < 1 or self.hash_buckets < 1:
            raise ValueError(f"min_count={self.min_count}, hash_buckets={self.hash_buckets}: expected values >= 1")


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
            self.handles[name].write(np.ascontiguousarray(a, dtype=self.SPECS[name]).data)  # errno on a full disk
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


@dataclass
class Pass1:
    """What pass 1 leaves: the spilled rows, split sizes and the training statistics."""

    spill: _Spill
    split_rows: dict[str, int]
    key_counts: list[list[tuple[np.ndarray, np.ndarray]]]  # vocab: per field, (keys, counts) parts to merge
    bucket_counts: np.ndarray | None                       # hash: [fields, buckets] training counts
    lo: np.ndarray                                         # minmax: each dense column's training range
    hi: np.ndarray
    skipped: dict[str, int]


def _field_keys(table: pa.Table, column: str, train_rows: np.ndarray | None, codes_out: np.ndarray,
                hash_buckets: int | None) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray | None]:
    """One field of a block: writes its per-row codes; returns its distinct keys, the training
    (keys, counts) and, with hashing, the training counts per bucket."""
    codes_out[:], distinct = factorized_string_keys(table.column(column))
    k, c = train_counts(codes_out, distinct, train_rows)
    buckets = None
    if hash_buckets is not None:
        buckets = np.bincount((k % np.uint64(hash_buckets)).astype(np.int64), weights=c,
                              minlength=hash_buckets).astype(np.int64)
    return distinct, (k, c), buckets


def run_pass1(sources: Sources, schema: Schema, cfg: PreprocessConfig, total_rows: int, scratch: Path,
              pool: ThreadPoolExecutor) -> Pass1:
    """Parse every file once, in blocks; spill the rows to ``scratch``; gather split sizes and statistics."""
    hashed = cfg.categorical == "hash"
    n_cat, n_dense = len(schema.categorical), len(schema.dense)
    out = Pass1(_Spill(scratch), dict.fromkeys(SPLITS, 0), [[] for _ in range(n_cat)],
                np.zeros((n_cat, cfg.hash_buckets), np.int64) if hashed else None,
                np.full(n_dense, np.inf), np.full(n_dense, -np.inf), {})
    blocks = _Pass(sources, schema, cfg, total_rows, "preprocess pass 1/2")
    for table, split in prefetch(blocks):
        codes = np.empty((n_cat, table.num_rows), np.int32)
        train = split == SPLIT_CODES["train"]
        train_rows = None if train.all() else train
        per_field = list(pool.map(lambda j: _field_keys(table, schema.categorical[j], train_rows, codes[j],
                                                        cfg.hash_buckets if hashed else None), range(n_cat)))
        dense = _dense_raw(table, schema)
        label = table.column(schema.label).to_numpy().astype(np.int8)
        out.spill.append(split, label, dense, codes, [d for d, _, _ in per_field])
        for name, code in SPLIT_CODES.items():
            out.split_rows[name] += int(np.count_nonzero(split == code))
        if n_dense and cfg.dense_transform == "minmax" and train.any():
            with warnings.catch_warnings():  # a column may be all missing in a block
                warnings.simplefilter("ignore", RuntimeWarning)
                out.lo = np.fmin(out.lo, np.nanmin(dense[train], axis=0))
                out.hi = np.fmax(out.hi, np.nanmax(dense[train], axis=0))
        for j, (_, kc, buckets) in enumerate(per_field):
            if hashed:
                out.bucket_counts[j] += buckets
                continue
            out.key_counts[j].append(kc)
            if len(out.key_counts[j]) >= 8:
                out.key_counts[j] = [_merge_counts(out.key_counts[j])]
    out.lo, out.hi = np.where(np.isfinite(out.lo), out.lo, 0.0), np.where(np.isfinite(out.hi), out.hi, 0.0)
    out.skipped = blocks.skipped()
    if out.spill.rows == 0:
        raise BadInputError(f"{', '.join(str(p) for p, _ in sources)}: no data rows to preprocess"
                            + (f" ({sum(out.skipped.values())} skipped as bad)" if out.skipped else ""))
    return out


@dataclass
class Vocabulary:
    """Per categorical field: the kept keys in id order (vocab), the table size and the statistics."""

    keys: dict[str, np.ndarray]        # vocab only: key of id FIRST_VOCAB_ID + i at position i
    counts: dict[str, np.ndarray]      # vocab only: their training counts
    table_sizes: dict[str, int]
    stats: dict[str, dict]


def build_vocabulary(first: Pass1, schema: Schema, cfg: PreprocessConfig) -> Vocabulary:
    """Keys with training count >= ``min_count``, most frequent first (ties by key); or hash buckets."""
    vocab = Vocabulary({}, {}, {}, {})
    for j, c in enumerate(schema.categorical):
        if cfg.categorical == "hash":
            b = first.bucket_counts[j]
            vocab.stats[c] = _field_stats(b[b > 0], int((b > 0).sum()))
            vocab.table_sizes[c] = cfg.hash_buckets + FIRST_VOCAB_ID
            continue
        parts = first.key_counts[j]
        k, n = _merge_counts(parts) if parts else (np.zeros(0, np.uint64), np.zeros(0, np.int64))
        keep = n >= cfg.min_count
        order = np.lexsort((k[keep], -n[keep]))
        vocab.keys[c], vocab.counts[c] = k[keep][order], n[keep][order]
        vocab.stats[c] = _field_stats(n, len(vocab.keys[c]))
        vocab.table_sizes[c] = len(vocab.keys[c]) + FIRST_VOCAB_ID
    return vocab


def _encode(distinct: np.ndarray, codes: np.ndarray, order: np.ndarray, index: pd.Index | None,
            hash_buckets: int) -> np.ndarray:
    """Ids of one field of a block, in ``order``: only the block's distinct keys are looked up."""
    if index is None:
        ids = (distinct % np.uint64(hash_buckets)).astype(np.int32) + FIRST_VOCAB_ID
    else:
        pos = index.get_indexer(distinct)  # -1 where not in the vocabulary
        ids = np.where(pos >= 0, pos + FIRST_VOCAB_ID, OOV_ID).astype(np.int32)
    ids[distinct == 0] = MISSING_ID
    return ids[codes[order]]


def run_pass2(first: Pass1, vocab: Vocabulary, schema: Schema, cfg: PreprocessConfig, writer: StoreWriter,
              pool: ThreadPoolExecutor) -> dict[str, int]:
    """Encode the spilled rows and append them to the store; returns the positives per split."""
    for c in vocab.keys:
        pq.write_table(pa.table({"key": pa.array(vocab.keys[c], pa.uint64()), "count": vocab.counts[c]}),
                       writer.vocab_dir / f"{c}.parquet")
    # a pandas Index keeps its hash table between lookups (pc.index_in would rebuild it per chunk)
    index = [pd.Index(vocab.keys[c], dtype=np.uint64) if c in vocab.keys else None for c in schema.categorical]
    positives = dict.fromkeys(SPLITS, 0)
    for chunk in prefetch(first.spill.read()):
        # rows grouped by split (file order kept inside each): every split's rows are one slice
        order = np.argsort(chunk["split"], kind="stable")
        bounds = np.searchsorted(chunk["split"][order], np.arange(len(SPLITS) + 1))
        label = chunk["label"][order]
        dense = transform_dense(chunk["dense"][order], cfg, first.lo, first.hi)
        sparse = np.empty((len(schema.categorical), len(order)), np.int32)  # field-major: contiguous per field

        def encode(j: int) -> None:
            sparse[j] = _encode(chunk["distinct"][j], chunk["codes"][j], order, index[j], cfg.hash_buckets)

        list(pool.map(encode, range(len(schema.categorical))))
        for name, code in SPLIT_CODES.items():
            rows = slice(bounds[code], bounds[code + 1])
            if rows.stop > rows.start:
                writer.append(name, label[rows], dense[rows], sparse[:, rows].T)
                positives[name] += int(label[rows].sum())
    return positives


def preprocess(files: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]], schema: Schema,
               cfg: PreprocessConfig, out_dir: str | os.PathLike, provenance: dict | None = None) -> ColumnarStore:
    """Build the store for ``files`` at ``out_dir`` (atomically; see :class:`StoreWriter`)."""
    sources = sources_from(files)
    if (cfg.split.method == "given") != all(split is not None for _, split in sources):
        raise ValueError("preprocess.split.method='given' needs data.path as a mapping split → files (and only then)")
    t0 = time.perf_counter()
    total_rows = sum(_count_lines(p) - int(schema.header) for p, _ in sources) if cfg.split.method == "sequential" else -1
    writer: StoreWriter | None = None
    first: Pass1 | None = None
    scratch = Path(out_dir).with_name(Path(out_dir).name + f".scratch-{os.getpid()}")
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(schema.categorical), os.cpu_count() or 1)))
    try:
        row_bytes = 1 + 4 * len(schema.dense) + 4 * len(schema.categorical)  # label, dense values, ids
        ensure_space(scratch, sum(os.path.getsize(p) for p, _ in sources) // 2)  # spill ≈ the parsed rows
        scratch.mkdir(parents=True, exist_ok=True)
        first = run_pass1(sources, schema, cfg, total_rows, scratch, pool)
        vocab = build_vocabulary(first, schema, cfg)
        ensure_space(out_dir, first.spill.rows * row_bytes)
        writer = StoreWriter(out_dir, first.split_rows, len(schema.dense), len(schema.categorical))
        positives = run_pass2(first, vocab, schema, cfg, writer, pool)
        rows = first.split_rows
        meta = {
            "schema": schema.name,
            "dense": list(schema.dense),
            "categorical": list(schema.categorical),
            "table_sizes": vocab.table_sizes,
            "splits": rows,
            "positive_rate": {k: positives[k] / rows[k] if rows[k] else None for k in SPLITS},
            **({"dense_range": {c: [float(first.lo[j]), float(first.hi[j])] for j, c in enumerate(schema.dense)}}
               if cfg.dense_transform == "minmax" else {}),
            "skipped_rows": first.skipped,
            "stats": vocab.stats,
            "preprocess": asdict(cfg),
            "provenance": provenance or {},
            "seconds": time.perf_counter() - t0,
        }
        return writer.commit(meta)
    except BaseException as e:
        if writer is not None:
            writer.abort()
        if isinstance(e, OSError) and not isinstance(e, DiskFullError):
            needed = first.spill.rows * row_bytes if first is not None else sum(os.path.getsize(p) for p, _ in sources)
            full = disk_full(e, writer.tmp_dir if writer is not None else scratch, needed)
            if full is not None:
                raise full from e
        raise
    finally:
        pool.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
