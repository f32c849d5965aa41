"""Preprocessing pass 1 (:mod:`pipeline.data.preprocess`): parse every raw file once, in blocks, assign
each row its split, factorize each sparse feature's values into 64-bit keys, spill the rows to scratch
files and gather the training statistics (key or hash-bucket counts, numeric ranges).

Split: ``random`` — a pure function of (seed, row number); ``sequential`` — the last ``test`` and,
before it, the last ``valid`` fractions of the rows; ``given`` — by file (``path`` is a mapping
split → files).
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.dataset import DataConfig
from pipeline.data.features import FeatureBlock, extract, sparse_features
from pipeline.data.hashing import factorized_string_keys, hash_keys, to_unit
from pipeline.data.other_readers import open_reader
from pipeline.data.prefetch import prefetch
from pipeline.data.preprocess_config import SplitConfig
from pipeline.data.raw_files import open_lines
from pipeline.data.reader import RawReader
from pipeline.data.store import SPLITS
from pipeline.runtime.errors import BadInputError

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


def count_rows(path: Path, data: DataConfig) -> int:
    if data.format == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    n = 0
    with open_lines(path) as fh:
        while chunk := fh.read(1 << 24):
            n += chunk.count(b"\n")
    return n - int(data.header)


def merge_counts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
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


def widen_range(lo: np.ndarray, hi: np.ndarray, numeric: np.ndarray, columns: list[int]) -> None:
    """Widen the running range [lo, hi] of ``columns`` (in place) by the training rows ``numeric`` (NaN = missing)."""
    if columns and len(numeric):
        with warnings.catch_warnings():  # a column may be all missing in a block
            warnings.simplefilter("ignore", RuntimeWarning)
            lo[columns] = np.fmin(lo[columns], np.nanmin(numeric[:, columns], axis=0))
            hi[columns] = np.fmax(hi[columns], np.nanmax(numeric[:, columns], axis=0))


def finite_range(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The range with columns never seen set to [0, 0] (min-max then maps them to 0)."""
    return np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 0.0)


def no_rows_error(sources: Sources, skipped: dict[str, int]) -> BadInputError:
    """The files held no data row (perhaps every row skipped as bad)."""
    return BadInputError(f"{', '.join(str(p) for p, _ in sources)}: no data rows to preprocess"
                         + (f" ({sum(skipped.values())} skipped as bad)" if skipped else ""))


class Spill:
    """Pass-1 blocks on disk: split code, label, raw numeric values (NaN = missing), each sparse
    feature's codes (one per row, or one per value of a sequence; concatenated), each sparse feature's
    distinct keys (concatenated), the bag lengths of the sequence features ([sequences, rows]) and the rows'
    times (``data.time``; else none)."""

    SPECS = {"split": np.int8, "label": np.int8, "dense": np.float32, "codes": np.int32, "distinct": np.uint64,
             "lengths": np.int32, "time": np.int64}

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # rows, dense width, codes per feature, distinct keys per feature, sequence features, timed
        self.blocks: list[tuple[int, int, tuple[int, ...], tuple[int, ...], int, bool]] = []
        self.handles = {name: open(folder / f"{name}.bin", "wb") for name in self.SPECS}

    @property
    def rows(self) -> int:
        return sum(b[0] for b in self.blocks)

    def append(self, split: np.ndarray, block: FeatureBlock, codes: list[np.ndarray], distinct: list[np.ndarray]) -> None:
        lengths = [x for x in block.lengths if x is not None]
        empty = np.zeros(0)
        arrays = {"split": split, "label": block.label, "dense": block.numeric,
                  "codes": np.concatenate(codes) if codes else empty, "distinct": np.concatenate(distinct) if distinct else empty,
                  "lengths": np.concatenate(lengths) if lengths else empty,
                  "time": empty if block.time is None else block.time}
        for name, a in arrays.items():
            self.handles[name].write(np.ascontiguousarray(a, dtype=self.SPECS[name]).data)  # errno on a full disk
        self.blocks.append((len(split), block.numeric.shape[1], tuple(len(c) for c in codes),
                            tuple(len(d) for d in distinct), len(lengths), block.time is not None))

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
            for n, width, code_sizes, sizes, n_seq, timed in self.blocks:
                distinct = take("distinct", sum(sizes))
                yield {"split": take("split", n), "label": take("label", n),
                       "dense": take("dense", n * width).reshape(n, width),
                       "codes": parts(take("codes", sum(code_sizes)), code_sizes),
                       "distinct": parts(distinct, sizes),
                       "lengths": take("lengths", n * n_seq).reshape(n_seq, n),
                       "time": take("time", n) if timed else None}
        finally:
            for fh in readers.values():
                fh.close()


class ParsedBlocks:
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

    spill: Spill
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


def run_pass1(sources: Sources, data: DataConfig, total_rows: int, spill: Spill, pool: ThreadPoolExecutor) -> Pass1:
    """Parse every file once, in blocks; spill the rows to ``spill``; gather split sizes and statistics."""
    cfg = data.preprocess
    hashed = cfg.categorical == "hash"
    tables = Tables.of_data(data)
    n_dense = len(data.numeric)
    out = Pass1(spill, dict.fromkeys(SPLITS, 0), {s: [0] * len(data.sequence) for s in SPLITS},
                [[] for _ in tables.names], np.zeros((len(tables.names), cfg.hash_buckets), np.int64) if hashed else None,
                np.full(n_dense, np.inf), np.full(n_dense, -np.inf), {}, {})
    blocks = ParsedBlocks(sources, data, total_rows, "preprocess pass 1/2")
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
        if minmax:
            widen_range(out.lo, out.hi, block.numeric[train], minmax)
        for j, (_, counted) in enumerate(per_feature):
            t, (k, c) = tables.of[j], counted
            if hashed:
                out.bucket_counts[t] += np.bincount((k % np.uint64(cfg.hash_buckets)).astype(np.int64), weights=c,
                                                    minlength=cfg.hash_buckets).astype(np.int64)
                continue
            out.key_counts[t].append((k, c))
            if len(out.key_counts[t]) >= 8:
                out.key_counts[t] = [merge_counts(out.key_counts[t])]
    out.lo, out.hi = finite_range(out.lo, out.hi)
    out.skipped, out.truncated = blocks.skipped(), blocks.truncated
    if out.spill.rows == 0:
        raise no_rows_error(sources, out.skipped)
    return out

