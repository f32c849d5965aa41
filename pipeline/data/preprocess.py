"""Streaming two-pass preprocessing of raw CTR files into a :mod:`pipeline.data.store`.

Pass 1 parses the files once, in blocks (the reader of the dataset's format, then
:func:`pipeline.data.features.extract`): it assigns every row to a split, turns every categorical and
sequence value into a 64-bit key (:func:`pipeline.data.hashing.bytes_keys` of its UTF-8 bytes;
0 = missing) and factorizes each feature's keys within the block (hash-based: the block's distinct
keys plus a 32-bit code per value — one per row, or one per value of a sequence with the bag lengths; :func:`pipeline.data.hashing.factorized_string_keys`
factorizes fixed-width values of up to 8 bytes by their raw bytes and hashes only the distinct
ones). It spills split code, label, raw dense values, codes and distinct keys to scratch files
(ordinary writes) and gathers training statistics: key counts (or hashed-bucket counts) and, for
min-max scaling, each dense column's range. Pass 2 reads the scratch files back in chunks (no
re-parsing), looks up only each block's distinct keys in the vocabulary, gathers the ids by code,
and writes the store:

* categorical and sequence, ``vocab``: per embedding table (features with ``share_table_with`` count
  into one), values with training count >= ``min_count``, most frequent first (ties by key), get ids
  2..; missing → 1; anything else (rare, or unseen in training) → 0 (OOV);
* categorical, ``hash``: ``2 + key mod buckets`` (no vocabulary); missing → 1;
* numeric, per feature: ``log1p(max(x, 0))``, min-max ``(x - min) / (max - min)`` clipped to [0, 1], or
  none; missing → 0;
* split: ``random`` — a pure function of (seed, row number); ``sequential`` — the last ``test``
  and, before it, the last ``valid`` fractions of the rows; ``given`` — by file (``path`` is a
  mapping split → files).

Memory is bounded by the vocabularies and one block, not by the file size. Keys identify values
(a 64-bit collision among 10^7 distinct values of a field has probability ~3·10^-6); the
vocabulary file lists each kept key with its count, so new data is encoded by hashing its values.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.hashing import factorized_string_keys, hash_keys, to_unit
from pipeline.data.prefetch import prefetch
from pipeline.data.dataset import DataConfig
from pipeline.data.features import FeatureBlock, extract, sparse_features
from pipeline.data.other_readers import open_reader
from pipeline.data.preprocess_config import SplitConfig
from pipeline.data.reader import BadInputError, RawReader, open_lines
from pipeline.data.vocab_growth import FREE, TableVocabulary, VocabIndex, fresh, grow
from pipeline.data.store import FIRST_VOCAB_ID, MISSING_ID, OOV_ID, SPLITS, ColumnarStore, StoreWriter
from pipeline.runtime.errors import DiskFullError, disk_full, ensure_space

SPLIT_CODES = {name: i for i, name in enumerate(SPLITS)}
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


def _count_rows(path: Path, data: DataConfig) -> int:
    if data.format == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    n = 0
    with open_lines(path) as fh:
        while chunk := fh.read(1 << 24):
            n += chunk.count(b"\n")
    return n - int(data.header)


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


def transform_dense(x: np.ndarray, transforms: Sequence[str], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[n, d] raw float32 values (NaN = missing) → float32 features (missing → 0), column j by
    ``transforms[j]``: ``log1p`` — log(1 + max(x, 0)); ``minmax`` — (x − lo) / (hi − lo) clipped to
    [0, 1] (0 where the training range is empty); ``none`` — x. Works in place."""
    y = np.asarray(x, dtype=np.float32)
    kinds = np.asarray(transforms)
    log = np.flatnonzero(kinds == "log1p")
    if len(log) == y.shape[1]:
        # log(1 + x) is log1p(x) to float32 rounding for integer counts (Criteo's) and, unlike log1p,
        # vectorised: 5x faster
        np.maximum(y, 0.0, out=y)
        y += 1.0
        np.log(y, out=y)
    elif len(log):
        y[:, log] = np.log(np.maximum(y[:, log], 0.0) + 1.0)
    mm = np.flatnonzero(kinds == "minmax")
    if len(mm):
        lo32, hi32 = lo[mm].astype(np.float32), hi[mm].astype(np.float32)
        span = np.where(hi32 > lo32, hi32 - lo32, np.float32(1.0))
        y[:, mm] = np.clip((y[:, mm] - lo32) / span, 0.0, 1.0) * (hi32 > lo32)
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
    """Pass-1 blocks on disk: split code, label, raw numeric values (NaN = missing), each sparse
    feature's codes (one per row, or one per value of a sequence; concatenated), each sparse feature's
    distinct keys (concatenated) and the bag lengths of the sequence features ([sequences, rows])."""

    SPECS = {"split": np.int8, "label": np.int8, "dense": np.float32, "codes": np.int32, "distinct": np.uint64,
             "lengths": np.int32}

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # rows, dense width, codes per feature, distinct keys per feature, sequence features
        self.blocks: list[tuple[int, int, tuple[int, ...], tuple[int, ...], int]] = []
        self.handles = {name: open(folder / f"{name}.bin", "wb") for name in self.SPECS}

    @property
    def rows(self) -> int:
        return sum(b[0] for b in self.blocks)

    def append(self, split: np.ndarray, block: FeatureBlock, codes: list[np.ndarray], distinct: list[np.ndarray]) -> None:
        lengths = [x for x in block.lengths if x is not None]
        empty = np.zeros(0)
        arrays = {"split": split, "label": block.label, "dense": block.numeric,
                  "codes": np.concatenate(codes) if codes else empty, "distinct": np.concatenate(distinct) if distinct else empty,
                  "lengths": np.concatenate(lengths) if lengths else empty}
        for name, a in arrays.items():
            self.handles[name].write(np.ascontiguousarray(a, dtype=self.SPECS[name]).data)  # errno on a full disk
        self.blocks.append((len(split), block.numeric.shape[1], tuple(len(c) for c in codes),
                            tuple(len(d) for d in distinct), len(lengths)))

    def close(self) -> None:
        for fh in self.handles.values():
            fh.close()

    def read(self) -> Iterator[dict[str, Any]]:
        self.close()
        readers = {name: open(self.folder / f"{name}.bin", "rb") for name in self.SPECS}

        def take(name: str, count: int) -> np.ndarray:
            return np.fromfile(readers[name], dtype=self.SPECS[name], count=count)

        def parts(a: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
            return np.split(a, np.cumsum(sizes)[:-1]) if sizes else []

        try:
            for n, width, code_sizes, sizes, n_seq in self.blocks:
                distinct = take("distinct", sum(sizes))
                yield {"split": take("split", n), "label": take("label", n),
                       "dense": take("dense", n * width).reshape(n, width),
                       "codes": parts(take("codes", sum(code_sizes)), code_sizes),
                       "distinct": parts(distinct, sizes),
                       "lengths": take("lengths", n * n_seq).reshape(n_seq, n)}
        finally:
            for fh in readers.values():
                fh.close()


class _Pass:
    """Iterates (feature block, split codes) over all sources; row numbers continue across files."""

    def __init__(self, sources: Sources, data: DataConfig, total_rows: int, desc: str):
        self.sources, self.data, self.total_rows, self.desc = sources, data, total_rows, desc
        self.readers: list[RawReader] = []
        self.truncated: dict[str, int] = {}

    def __iter__(self) -> Iterator[tuple[FeatureBlock, np.ndarray]]:
        row0, cfg = 0, self.data.preprocess
        for path, fixed in self.sources:
            reader = open_reader([path], self.data, cfg.block_size, cfg.bad_rows, self.desc)
            self.readers.append(reader)
            for table in reader:
                block = extract(table, self.data, reader.where, self.truncated)
                n = block.rows
                if fixed is not None:
                    codes = np.full(n, SPLIT_CODES[fixed], dtype=np.int8)
                else:
                    codes = assign_splits(np.arange(row0, row0 + n, dtype=np.uint64), self.total_rows, cfg.split)
                row0 += n
                yield block, codes

    def skipped(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.readers:
            for k, v in r.skipped.as_dict().items():
                out[k] = out.get(k, 0) + v
        return out


@dataclass(frozen=True)
class Tables:
    """The embedding tables of a declaration: ``of[j]`` is the table index of sparse feature j."""

    names: tuple[str, ...]
    of: tuple[int, ...]

    @classmethod
    def of_data(cls, data: DataConfig) -> "Tables":
        feats = sparse_features(data)
        names = tuple(dict.fromkeys(data.table_of(f.name) for f in feats))
        return cls(names, tuple(names.index(data.table_of(f.name)) for f in feats))


@dataclass
class Pass1:
    """What pass 1 leaves: the spilled rows, split sizes and the training statistics."""

    spill: _Spill
    split_rows: dict[str, int]
    split_values: dict[str, list[int]]                     # per split: values of each sequence feature
    key_counts: list[list[tuple[np.ndarray, np.ndarray]]]  # vocab: per table, (keys, counts) parts to merge
    bucket_counts: np.ndarray | None                       # hash: [tables, buckets] training counts
    lo: np.ndarray                                         # minmax: each numeric feature's training range
    hi: np.ndarray
    skipped: dict[str, int]
    truncated: dict[str, int]


def _feature_keys(values: pa.Array, train: np.ndarray | None, codes_out: np.ndarray
                  ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One sparse feature of a block: writes its codes (one per value); returns its distinct keys and
    the training (keys, counts)."""
    codes_out[:], distinct = factorized_string_keys(values)
    return distinct, train_counts(codes_out, distinct, train)


def run_pass1(sources: Sources, data: DataConfig, total_rows: int, spill: _Spill, pool: ThreadPoolExecutor) -> Pass1:
    """Parse every file once, in blocks; spill the rows to ``spill``; gather split sizes and statistics."""
    cfg = data.preprocess
    hashed = cfg.categorical == "hash"
    tables = Tables.of_data(data)
    n_dense = len(data.numeric)
    out = Pass1(spill, dict.fromkeys(SPLITS, 0), {s: [0] * len(data.sequence) for s in SPLITS},
                [[] for _ in tables.names], np.zeros((len(tables.names), cfg.hash_buckets), np.int64) if hashed else None,
                np.full(n_dense, np.inf), np.full(n_dense, -np.inf), {}, {})
    blocks = _Pass(sources, data, total_rows, "preprocess pass 1/2")
    minmax = [j for j, f in enumerate(data.numeric) if data.decl(f).transform == "minmax"]
    for block, split in prefetch(blocks):
        train = split == SPLIT_CODES["train"]
        masks = [None if train.all() else train if lengths is None else np.repeat(train, lengths)
                 for lengths in block.lengths]
        codes = [np.empty(len(v), np.int32) for v in block.sparse]
        per_feature = list(pool.map(lambda j: _feature_keys(block.sparse[j], masks[j], codes[j]),
                                    range(len(codes))))
        out.spill.append(split, block, codes, [d for d, _ in per_feature])
        for name, code in SPLIT_CODES.items():
            rows = split == code
            out.split_rows[name] += int(np.count_nonzero(rows))
            for k, lengths in enumerate(x for x in block.lengths if x is not None):
                out.split_values[name][k] += int(lengths[rows].sum())
        if minmax and train.any():
            with warnings.catch_warnings():  # a column may be all missing in a block
                warnings.simplefilter("ignore", RuntimeWarning)
                out.lo[minmax] = np.fmin(out.lo[minmax], np.nanmin(block.numeric[train][:, minmax], axis=0))
                out.hi[minmax] = np.fmax(out.hi[minmax], np.nanmax(block.numeric[train][:, minmax], axis=0))
        for j, (_, (k, c)) in enumerate(per_feature):
            t = tables.of[j]
            if hashed:
                out.bucket_counts[t] += np.bincount((k % np.uint64(cfg.hash_buckets)).astype(np.int64), weights=c,
                                                    minlength=cfg.hash_buckets).astype(np.int64)
                continue
            out.key_counts[t].append((k, c))
            if len(out.key_counts[t]) >= 8:
                out.key_counts[t] = [_merge_counts(out.key_counts[t])]
    out.lo, out.hi = np.where(np.isfinite(out.lo), out.lo, 0.0), np.where(np.isfinite(out.hi), out.hi, 0.0)
    out.skipped, out.truncated = blocks.skipped(), blocks.truncated
    if out.spill.rows == 0:
        raise BadInputError(f"{', '.join(str(p) for p, _ in sources)}: no data rows to preprocess"
                            + (f" ({sum(out.skipped.values())} skipped as bad)" if out.skipped else ""))
    return out


@dataclass
class Vocabulary:
    """Per embedding table: the keys in id order (vocab; :class:`TableVocabulary`), the table size and the
    statistics (occurrences: every value of every feature reading the table, sequences included)."""

    tables: dict[str, TableVocabulary]  # vocab only: key of id FIRST_VOCAB_ID + i at position i (FREE: none)
    table_sizes: dict[str, int]
    stats: dict[str, dict]
    day: int = 0                        # 0, or the base vocabulary's day + 1


def _folder_meta(folder: str | os.PathLike) -> dict:
    """The store meta of a store folder (meta.json) or a model folder (model.json)."""
    folder = Path(folder)
    if (folder / "meta.json").is_file():
        return json.loads((folder / "meta.json").read_text())
    if (folder / "model.json").is_file():
        return json.loads((folder / "model.json").read_text())["store"]
    raise ValueError(f"data.preprocess.base_vocabulary={folder}: not a store or model folder (no meta.json or "
                     f"model.json)")


def base_vocabulary(folder: str | os.PathLike, table: str) -> TableVocabulary | None:
    """A table's vocabulary in a store or model folder's ``vocab/`` (None: no such table there)."""
    path = Path(folder) / "vocab" / f"{table}.parquet"
    if not path.is_file():
        return None
    t = pq.read_table(path)
    n = t.num_rows
    column = (lambda name, dtype: t.column(name).to_numpy().astype(dtype) if name in t.column_names
              else np.zeros(n, dtype))
    return TableVocabulary(column("key", np.uint64), column("count", np.int64), column("last_seen", np.int32),
                           column("since", np.int32))


def build_vocabulary(first: Pass1, data: DataConfig) -> Vocabulary:
    """Keys with training count >= ``min_count``, most frequent first (ties by key); or hash buckets.

    With ``preprocess.base_vocabulary`` (an earlier store or model folder) the vocabulary continues the
    base's (:mod:`pipeline.data.vocab_growth`): its keys keep their ids, new keys with ``min_count``
    take free positions or are appended, and with ``preprocess.evict_after`` keys unseen for that many
    days free their positions."""
    cfg = data.preprocess
    day = int(_folder_meta(cfg.base).get("vocabulary_day", 0)) + 1 if cfg.base else 0
    vocab = Vocabulary({}, {}, {}, day)
    for t, name in enumerate(Tables.of_data(data).names):
        if cfg.categorical == "hash":
            b = first.bucket_counts[t]
            vocab.stats[name] = _field_stats(b[b > 0], int((b > 0).sum()))
            vocab.table_sizes[name] = cfg.hash_buckets + FIRST_VOCAB_ID
            continue
        parts = first.key_counts[t]
        k, n = _merge_counts(parts) if parts else (np.zeros(0, np.uint64), np.zeros(0, np.int64))
        base = base_vocabulary(cfg.base, name) if cfg.base else None
        if base is None:
            keep = n >= cfg.min_count
            order = np.lexsort((k[keep], -n[keep]))
            table = fresh(k[keep][order], n[keep][order], day)
        else:
            table = grow(base, k, n, cfg.min_count, day, cfg.evict_after)
        vocab.tables[name] = table
        vocab.stats[name] = _field_stats(n, int(np.count_nonzero(table.keys != FREE)))
        vocab.table_sizes[name] = len(table.keys) + FIRST_VOCAB_ID
    return vocab


def encode_ids(distinct: np.ndarray, codes: np.ndarray, index: VocabIndex | None, hash_buckets: int) -> np.ndarray:
    """Ids of one feature's values given as (distinct keys, code per value): only the distinct keys
    are looked up (``index``: the table's vocabulary; None: hashing)."""
    if index is None:
        ids = (distinct % np.uint64(hash_buckets)).astype(np.int32) + FIRST_VOCAB_ID
    else:
        pos = index.positions_of(distinct)  # -1 where not in the vocabulary
        ids = np.where(pos >= 0, pos + FIRST_VOCAB_ID, OOV_ID).astype(np.int32)
    ids[distinct == 0] = MISSING_ID
    return ids[codes]


def ragged_take(lengths: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, values) of the bags ``rows`` of a ragged array given by its ``lengths`` per row."""
    starts = np.cumsum(lengths) - lengths
    picked = lengths[rows]
    index = np.repeat(starts[rows] - (np.cumsum(picked) - picked), picked) + np.arange(int(picked.sum()))
    return picked, values[index]


def run_pass2(first: Pass1, vocab: Vocabulary, data: DataConfig, writer: StoreWriter,
              pool: ThreadPoolExecutor) -> dict[str, int]:
    """Encode the spilled rows and append them to the store; returns the positives per split."""
    cfg = data.preprocess
    for name, table in vocab.tables.items():
        pq.write_table(pa.table({"key": pa.array(table.keys, pa.uint64()), "count": table.counts,
                                 "last_seen": table.last_seen, "since": table.since}),
                       writer.vocab_dir / f"{name}.parquet")
    tables = Tables.of_data(data)
    # a pandas Index keeps its hash table between lookups (pc.index_in would rebuild it per chunk)
    index = {name: VocabIndex(vocab.tables[name].keys) if name in vocab.tables else None for name in tables.names}
    n_cat = len(data.categorical)
    transforms = [data.decl(f).transform for f in data.numeric]
    positives = dict.fromkeys(SPLITS, 0)
    for chunk in prefetch(first.spill.read()):
        # rows grouped by split (file order kept inside each): every split's rows are one slice
        order = np.argsort(chunk["split"], kind="stable")
        bounds = np.searchsorted(chunk["split"][order], np.arange(len(SPLITS) + 1))
        label = chunk["label"][order]
        dense = transform_dense(chunk["dense"][order], transforms, first.lo, first.hi)
        sparse = np.empty((n_cat, len(order)), np.int32)  # field-major: contiguous per field
        sequences: list[tuple[np.ndarray, np.ndarray]] = []

        def encode(j: int) -> np.ndarray:
            return encode_ids(chunk["distinct"][j], chunk["codes"][j], index[tables.names[tables.of[j]]],
                              cfg.hash_buckets)

        for j, ids in enumerate(pool.map(encode, range(len(tables.of)))):
            if j < n_cat:
                sparse[j] = ids[order]
            else:
                sequences.append(ragged_take(chunk["lengths"][j - n_cat], ids, order))
        for name, code in SPLIT_CODES.items():
            lo, hi = int(bounds[code]), int(bounds[code + 1])
            if hi > lo:
                bags = [(lengths[lo:hi], values[lengths[:lo].sum():lengths[:hi].sum()])
                        for lengths, values in sequences]
                writer.append(name, label[lo:hi], dense[lo:hi], sparse[:, lo:hi].T, bags)
                positives[name] += int(label[lo:hi].sum())
    return positives


def preprocess(files: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]], data: DataConfig,
               out_dir: str | os.PathLike, provenance: dict | None = None) -> ColumnarStore:
    """Build the store of dataset ``data`` from ``files`` at ``out_dir`` (atomically; see :class:`StoreWriter`)."""
    cfg = data.preprocess
    if not data.declared():
        raise ValueError(f"data.features is empty: declare the features of data={data.name} (docs/datasets.md)")
    sources = sources_from(files)
    if (cfg.split.method == "given") != all(split is not None for _, split in sources):
        raise ValueError("preprocess.split.method='given' needs data.path as a mapping split → files (and only then)")
    t0 = time.perf_counter()
    total_rows = sum(_count_rows(p, data) for p, _ in sources) if cfg.split.method == "sequential" else -1
    writer: StoreWriter | None = None
    first: Pass1 | None = None
    spill: _Spill | None = None
    scratch = Path(out_dir).with_name(Path(out_dir).name + f".scratch-{os.getpid()}")
    sparse = sparse_features(data)
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(sparse), os.cpu_count() or 1)))
    try:
        row_bytes = 1 + 4 * len(data.numeric) + 4 * len(data.categorical)  # label, dense values, ids
        ensure_space(scratch, sum(os.path.getsize(p) for p, _ in sources) // 2)  # spill ≈ the parsed rows
        scratch.mkdir(parents=True, exist_ok=True)
        spill = _Spill(scratch)
        first = run_pass1(sources, data, total_rows, spill, pool)
        vocab = build_vocabulary(first, data)
        seq_bytes = 12 * sum(sum(v) for v in first.split_values.values())  # values + offsets, roughly
        ensure_space(out_dir, first.spill.rows * row_bytes + seq_bytes)
        writer = StoreWriter(out_dir, first.split_rows, len(data.numeric), len(data.categorical),
                             {s: dict(zip(data.sequence, v)) for s, v in first.split_values.items()})
        positives = run_pass2(first, vocab, data, writer, pool)
        rows = first.split_rows
        tables = Tables.of_data(data)
        meta = {
            "dataset": data.name,
            "dense": list(data.numeric),
            "categorical": list(data.categorical),
            "sequence": list(data.sequence),
            "features": [{"name": f.name, "type": f.type, "table": tables.names[t],
                          **({"pooling": f.pooling} if f.type == "sequence" else {})}
                         for f, t in zip(sparse, tables.of)],
            "transforms": {f: data.decl(f).transform for f in data.numeric},
            "table_sizes": vocab.table_sizes,
            "vocabulary_day": vocab.day,
            "splits": rows,
            "positive_rate": {k: positives[k] / rows[k] if rows[k] else None for k in SPLITS},
            **({"dense_range": {c: [float(first.lo[j]), float(first.hi[j])] for j, c in enumerate(data.numeric)
                                if data.decl(c).transform == "minmax"}}
               if any(data.decl(c).transform == "minmax" for c in data.numeric) else {}),
            "skipped_rows": first.skipped,
            "truncated_rows": first.truncated,
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
        if spill is not None:
            spill.close()
        shutil.rmtree(scratch, ignore_errors=True)
