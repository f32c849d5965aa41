"""Columnar binary store: memory-mappable ``.npy`` arrays per split plus ``meta.json``.

Layout of a store directory::

    meta.json               fields, table sizes, split sizes, statistics, provenance
    vocab/<field>.parquet   kept values and their training counts, most frequent first
    <split>/label.npy       int8   [N]
    <split>/dense.npy       float32[N, n_dense]   (already transformed, missing = 0)
    <split>/sparse.npy      int32  [N, n_cat]     one id per categorical feature (0 = OOV, 1 = missing, 2.. = vocabulary)
    <split>/seq/<f>.values.npy   int32 [V_f]       the ids of sequence feature f, row after row
    <split>/seq/<f>.offsets.npy  int64 [N + 1]     row i's ids: values[offsets[i]:offsets[i+1]] (at least one)
    <split>/time.npy        int64  [N]            each row's time, seconds since 1970 (only with ``data.time``)

With ``categorical: raw`` the ids are int64 (``meta["id_dtype"]``): 63-bit ids of the values, 0 = missing,
no vocabulary and no table sizes (``model.zch`` sizes the tables).

A store is built in ``<dir>.tmp-<pid>`` and renamed into place when complete, so a directory
with a ``meta.json`` is always a finished store. The writer appends rows to each array file
(ordinary writes, not a memory map), so its memory does not grow with the data.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

FORMAT_VERSION = 3  # 2: vocabulary keyed by 64-bit value keys; coverage statistics. 3: sequence features, tables
OOV_ID = 0
MISSING_ID = 1
FIRST_VOCAB_ID = 2
MAX_RAW_ID = (1 << 63) - 1  # raw ids lie in [1, MAX_RAW_ID - 1]; 0 = missing
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Ragged:
    """A sequence feature of a split: row i's ids are ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray   # int32 [V]
    offsets: np.ndarray  # int64 [N + 1]


@dataclass(frozen=True)
class SplitArrays:
    label: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    sequences: dict[str, Ragged] = field(default_factory=dict)
    time: np.ndarray | None = None  # int64 [N] seconds since 1970 (``data.time``)

    def __len__(self) -> int:
        return int(self.label.shape[0])

    @staticmethod
    def concat(parts: "list[SplitArrays]") -> "SplitArrays":
        """The rows of ``parts``, one after another (same features in each)."""
        if len(parts) == 1:
            return parts[0]
        sequences = {}
        for name in parts[0].sequences:
            ragged = [p.sequences[name] for p in parts]
            starts = np.cumsum([0] + [int(r.offsets[-1]) for r in ragged[:-1]])
            offsets = np.concatenate([[0]] + [r.offsets[1:] + s for r, s in zip(ragged, starts)])
            sequences[name] = Ragged(np.concatenate([r.values for r in ragged]), offsets.astype(np.int64))
        time = None if parts[0].time is None else np.concatenate([p.time for p in parts])
        return SplitArrays(np.concatenate([p.label for p in parts]), np.concatenate([p.dense for p in parts]),
                           np.concatenate([p.sparse for p in parts]), sequences, time)


def has_raw_ids(meta: dict[str, Any]) -> bool:
    """Whether a store (its meta) holds raw ids (``categorical: raw``): no vocabulary, no table sizes."""
    return meta.get("id_dtype") == "int64"


def with_table_sizes(meta: dict[str, Any], zch: Any) -> dict[str, Any]:
    """A store meta whose ``table_sizes`` are set: a raw store's from ``zch`` (``model.zch``,
    :meth:`modules.embedding.zch.config.ZchConfig.table_sizes`); another store's as they are. Refuses a mismatch."""
    if not has_raw_ids(meta):
        if zch.enabled:
            raise ValueError(f"model.zch.rows={zch.rows}: the store has a vocabulary or hashed ids; zero-collision "
                             f"tables take raw ids: set data.preprocess.categorical=raw")
        return meta
    if not zch.enabled:
        raise ValueError("data.preprocess.categorical=raw: the tables' sizes come from model.zch.rows=<rows per "
                         "table>, which is not set")
    if zch.eviction == "ttl" and zch.ttl_clock == "time" and not meta.get("time"):
        raise ValueError("model.zch.ttl_clock=time: the store keeps no row times; declare the column of each row's "
                         "time (data.time=<column>, data.time_format) or use ttl_clock=day")
    tables = list(dict.fromkeys(f["table"] for f in meta["features"]))
    return {**meta, "table_sizes": zch.table_sizes(tables)}


class ColumnarStore:
    """Read access to a finished store."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        meta_path = self.root / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.root} is not a finished columnar store (no meta.json)")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: format_version {self.meta.get('format_version')} != {FORMAT_VERSION}")

    @property
    def dense_names(self) -> list[str]:
        return list(self.meta["dense"])

    @property
    def categorical_names(self) -> list[str]:
        return list(self.meta["categorical"])

    @property
    def sequence_names(self) -> list[str]:
        return list(self.meta.get("sequence", []))

    @property
    def sparse_names(self) -> list[str]:
        """Every sparse feature: the categorical ones (columns of ``sparse.npy``), then the sequences."""
        return self.categorical_names + self.sequence_names

    @property
    def table_sizes(self) -> dict[str, int]:
        """Rows per embedding table (vocabulary + OOV + missing)."""
        return {k: int(v) for k, v in self.meta["table_sizes"].items()}

    def split(self, name: str, mmap: bool = True) -> SplitArrays:
        if name not in self.meta["splits"]:
            raise KeyError(f"split {name!r} not in store {self.root} (has {sorted(self.meta['splits'])})")
        d = self.root / name
        mode = "r" if mmap else None
        sequences = {f: Ragged(np.load(d / "seq" / f"{f}.values.npy", mmap_mode=mode),
                               np.load(d / "seq" / f"{f}.offsets.npy", mmap_mode=mode)) for f in self.sequence_names}
        time = np.load(d / "time.npy", mmap_mode=mode) if self.meta.get("time") else None
        return SplitArrays(*(np.load(d / f"{a}.npy", mmap_mode=mode) for a in ("label", "dense", "sparse")),
                           sequences=sequences, time=time)


ARRAYS = {"label": np.int8, "dense": np.float32, "sparse": np.int32}


def ragged_take(lengths: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, values) of the bags ``rows`` of a ragged array given by its ``lengths`` per row."""
    starts = np.cumsum(lengths) - lengths
    picked = lengths[rows]
    index = np.repeat(starts[rows] - (np.cumsum(picked) - picked), picked) + np.arange(int(picked.sum()))
    return picked, values[index]


class StoreWriter:
    """Builds a store in a temporary directory; ``commit`` renames it into place.

    Every array is appended to its ``.npy`` file (ordinary writes) behind a header written for zero rows and
    rewritten for the rows written at ``commit``: numpy's header leaves room for the first axis to grow to 21
    digits, so the header keeps its length and the data does not move. With ``planned`` rows per split (and
    ids per split and sequence feature), ``commit`` also checks that exactly those were written."""

    def __init__(self, final_dir: str | os.PathLike, n_dense: int, n_cat: int, sequences: Sequence[str] = (),
                 id_dtype: Any = np.int32, timed: bool = False,
                 planned: tuple[dict[str, int], dict[str, dict[str, int]]] | None = None) -> None:
        """``sequences``: the sequence features' names; ``id_dtype``: of the ids (int32; int64 for raw ids);
        ``timed``: a ``time`` array too (``data.time``); ``planned``: (rows per split, per split the ids of each sequence feature) that pass 1 counted."""
        self.final_dir = Path(final_dir)
        self.tmp_dir = self.final_dir.with_name(self.final_dir.name + f".tmp-{os.getpid()}")
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)
        self.planned = planned
        self.rows = dict.fromkeys(SPLITS, 0)
        self.values = {s: dict.fromkeys(sequences, 0) for s in SPLITS}
        self.arrays = {**ARRAYS, "sparse": np.dtype(id_dtype), **({"time": np.dtype(np.int64)} if timed else {})}
        self.widths = {"label": (), "dense": (n_dense,), "sparse": (n_cat,), "time": ()}
        self.files: dict[str, dict[str, Any]] = {}
        self.headers: dict[Path, int] = {}  # each file's header length
        for split in SPLITS:
            (self.tmp_dir / split).mkdir()
            self.files[split] = {name: self._open(self.tmp_dir / split / f"{name}.npy", dtype, (0, *self.widths[name]))
                                 for name, dtype in self.arrays.items()}
            for f in sequences:
                (self.tmp_dir / split / "seq").mkdir(exist_ok=True)
                self.files[split][f"{f}.values"] = self._open(self.tmp_dir / split / "seq" / f"{f}.values.npy",
                                                              self.arrays["sparse"], (0,))
                offsets = self._open(self.tmp_dir / split / "seq" / f"{f}.offsets.npy", np.int64, (0,))
                offsets.write(np.zeros(1, np.int64).data)
                self.files[split][f"{f}.offsets"] = offsets

    def _open(self, path: Path, dtype: Any, shape: tuple[int, ...]) -> Any:
        fh = open(path, "wb")
        self._header(fh, dtype, shape)
        self.headers[path] = fh.tell()
        return fh

    @staticmethod
    def _header(fh: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})

    def append(self, split: str, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray,
               sequences: Sequence[tuple[np.ndarray, np.ndarray]] = (), time: np.ndarray | None = None) -> None:
        """Rows of ``split``; ``sequences``: (lengths [n], ids) of each sequence feature, in order; ``time``:
        their times (a ``timed`` writer)."""
        if self.planned is not None and self.rows[split] + len(label) > self.planned[0][split]:
            raise RuntimeError(f"split {split} overflows its {self.planned[0][split]} planned rows")
        if ("time" in self.arrays) != (time is not None):
            raise RuntimeError(f"rows {'without' if time is None else 'with'} times for a store "
                               f"{'with' if 'time' in self.arrays else 'without'} a time array")
        for name, values in (("label", label), ("dense", dense), ("sparse", sparse), ("time", time)):
            if values is None:
                continue
            self.files[split][name].write(np.ascontiguousarray(values, dtype=self.arrays[name]).data)  # errno when full
        for f, (lengths, ids) in zip(self.values[split], sequences):
            start = self.values[split][f]
            self.files[split][f"{f}.values"].write(np.ascontiguousarray(ids, dtype=self.arrays["sparse"]).data)
            self.files[split][f"{f}.offsets"].write((start + np.cumsum(lengths, dtype=np.int64)).data)
            self.values[split][f] = start + int(np.sum(lengths))
        self.rows[split] += len(label)

    def append_block(self, split: np.ndarray, label: np.ndarray, dense: np.ndarray, columns: Sequence[np.ndarray],
                     sequences: Sequence[tuple[np.ndarray, np.ndarray]] = (),
                     time: np.ndarray | None = None) -> dict[str, int]:
        """A block of rows, each to its split by ``split`` (codes: index into :data:`SPLITS`), file order kept
        within a split; ``columns``: the ids of each categorical feature. Returns the positives per split."""
        order = np.argsort(split, kind="stable")
        bounds = np.searchsorted(split[order], np.arange(len(SPLITS) + 1))
        label, dense, time = label[order], dense[order], None if time is None else time[order]
        sparse = np.stack([c[order] for c in columns], axis=1) if len(columns) else \
            np.zeros((len(order), 0), self.arrays["sparse"])
        bags = [ragged_take(lengths, ids, order) for lengths, ids in sequences]
        positives = {}
        for code, name in enumerate(SPLITS):
            lo, hi = int(bounds[code]), int(bounds[code + 1])
            if hi > lo:
                starts = [(int(lengths[:lo].sum()), int(lengths[:hi].sum())) for lengths, _ in bags]
                self.append(name, label[lo:hi], dense[lo:hi], sparse[lo:hi],
                            [(lengths[lo:hi], ids[a:b]) for (lengths, ids), (a, b) in zip(bags, starts)],
                            None if time is None else time[lo:hi])
            positives[name] = int(label[lo:hi].sum())
        return positives

    def rewrite_dense(self, columns: Sequence[int], transform: Callable[[np.ndarray], np.ndarray],
                      block_rows: int = 1 << 20) -> None:
        """After the last append: rewrite ``columns`` of every split's dense array in place, block by block;
        ``transform`` maps a block's values [rows, len(columns)] to what the store holds."""
        for split in SPLITS if len(columns) else ():
            n, path = self.rows[split], self.tmp_dir / split / "dense.npy"
            if not n:
                continue
            self.files[split]["dense"].flush()
            dense = np.memmap(path, np.float32, "r+", offset=self.headers[path], shape=(n, *self.widths["dense"]))
            for a in range(0, n, block_rows):
                dense[a:a + block_rows, columns] = transform(np.array(dense[a:a + block_rows, columns]))
            dense.flush()
            del dense

    def _close(self) -> None:
        for group in self.files.values():
            for fh in group.values():
                fh.close()
        self.files.clear()

    @property
    def vocab_dir(self) -> Path:
        (self.tmp_dir / "vocab").mkdir(exist_ok=True)
        return self.tmp_dir / "vocab"

    def _shapes(self) -> dict[Path, tuple[Any, tuple[int, ...]]]:
        """Each file's dtype and final shape: the rows written."""
        out: dict[Path, tuple[Any, tuple[int, ...]]] = {}
        for split in SPLITS:
            for name, dtype in self.arrays.items():
                out[self.tmp_dir / split / f"{name}.npy"] = (dtype, (self.rows[split], *self.widths[name]))
            for f, n in self.values[split].items():
                out[self.tmp_dir / split / "seq" / f"{f}.values.npy"] = (self.arrays["sparse"], (n,))
                out[self.tmp_dir / split / "seq" / f"{f}.offsets.npy"] = (np.int64, (self.rows[split] + 1,))
        return out

    def commit(self, meta: dict[str, Any]) -> ColumnarStore:
        if self.planned is not None and (self.rows != self.planned[0] or self.values != self.planned[1]):
            raise RuntimeError(f"wrote {self.rows} rows and sequence ids {self.values}; planned {self.planned[0]} "
                               f"and {self.planned[1]}")
        self._close()
        for path, (dtype, shape) in self._shapes().items():
            with open(path, "r+b") as fh:
                self._header(fh, dtype, shape)
                if fh.tell() != self.headers[path]:
                    raise RuntimeError(f"{path}: the header for shape {shape} does not fit the space left for it")
        meta = {"format_version": FORMAT_VERSION, **meta}
        (self.tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        try:
            os.rename(self.tmp_dir, self.final_dir)
        except OSError:
            if not (self.final_dir / "meta.json").is_file():  # not a concurrent identical build
                raise
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return ColumnarStore(self.final_dir)

    def abort(self) -> None:
        self._close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
