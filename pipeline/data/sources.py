"""Where a dataset's raw files come from, and the cached store built from them (built once: a file lock
beside the store and beside a generated file lets concurrent runs wait for the first one's result).

A store lives at ``<cache_dir>/stores/<name>-<fingerprint>``; the fingerprint hashes what
determines its content (the dataset's declaration, the generator config or the raw files'
path/size/mtime, and the preprocessing config), so a second run with the same inputs reuses it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
from filelock import FileLock

from pipeline.data.dataset import DataConfig
from pipeline.data.preprocess import preprocess
from pipeline.data.store import FORMAT_VERSION, SPLITS, ColumnarStore
from pipeline.data.synthetic import generate


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolve_paths(data: DataConfig) -> list[Path] | dict[str, list[Path]]:
    """``data.path``: a file, a list of files, a directory (its files, sorted), a glob, or a mapping
    split → any of these (the dataset's own split)."""
    raw = data.path
    what = f"a {data.format} file of data={data.name}"
    if raw in (None, "", "???") or (isinstance(raw, Mapping) and not raw):
        raise ValueError(f"data.path is missing: set data.path=<file> ({what})")

    def files(value: Any, key: str) -> list[Path]:
        if value in (None, "", "???"):
            raise ValueError(f"{key} is missing: expected {what}")
        out: list[Path] = []
        for p in (value if isinstance(value, (list, tuple)) else [value]):
            p = Path(str(p)).expanduser()
            if p.is_dir():
                found = sorted(q for q in p.iterdir() if q.is_file() and not q.name.startswith("."))
            elif any(ch in str(p) for ch in "*?["):
                found = sorted(Path(q) for q in glob.glob(str(p)) if Path(q).is_file())
            else:
                found = [p] if p.is_file() else []
                if not found:
                    raise FileNotFoundError(f"{key}: {p} does not exist or is not a file (expected {what})")
            if not found:
                raise FileNotFoundError(f"{key}: {p} holds no files (expected {what})")
            out += found
        return out

    if isinstance(raw, Mapping):
        unknown = sorted(set(raw) - set(SPLITS))
        if unknown:
            raise ValueError(f"data.path: unknown splits {unknown}; expected keys among {list(SPLITS)}")
        return {split: files(v, f"data.path.{split}") for split, v in raw.items()}
    return files(raw, "data.path")


def raw_fingerprint(data: DataConfig) -> dict[str, Any]:
    """What identifies the raw input (without generating or reading it)."""
    if data.generated:
        return {"synthetic": asdict(data.synthetic)}
    paths = resolve_paths(data)
    described = {split: [_describe(p) for p in group] for split, group in paths.items()} \
        if isinstance(paths, dict) else [_describe(p) for p in paths]
    return {"files": described}


def _describe(p: Path) -> dict[str, Any]:
    st = p.stat()
    return {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def store_dir(data: DataConfig, cache_dir: str | os.PathLike) -> Path:
    declaration = {k: v for k, v in asdict(data).items() if k not in ("name", "path", "synthetic", "preprocess")}
    base = data.preprocess.base
    key = {"format": FORMAT_VERSION, "declaration": declaration, "raw": raw_fingerprint(data),
           "preprocess": {**asdict(data.preprocess), "base_vocabulary": base},
           "base_vocabulary": [_describe(p) for p in sorted(Path(base).glob("vocab/*.parquet"))] if base else None}
    return Path(cache_dir) / "stores" / f"{data.name}-{_digest(key)}"


def raw_files(data: DataConfig, cache_dir: str | os.PathLike) -> tuple[list[Path] | dict[str, list[Path]], dict[str, Any]]:
    """The raw files (generating the synthetic one if needed) and a provenance record."""
    if not data.generated:
        return resolve_paths(data), raw_fingerprint(data)
    cfg = data.synthetic
    path = Path(cache_dir) / "raw" / f"synthetic-{_digest(asdict(cfg))}.tsv"
    summary_path = Path(str(path) + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):  # concurrent runs generate it once
        if not (path.is_file() and summary_path.is_file()):
            generate(cfg, path)
    summary = json.loads(summary_path.read_text())
    return [path], {"synthetic_file": str(path), **{k: v for k, v in summary.items() if k != "config"}}


def prepare_store(data: DataConfig, cache_dir: str | os.PathLike) -> ColumnarStore:
    """Return the store for ``data``, building it (and the raw data) on first use."""
    target = store_dir(data, cache_dir)
    if (target / "meta.json").is_file():
        return ColumnarStore(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # a run started beside this one waits, then reuses its store
        if (target / "meta.json").is_file():
            return ColumnarStore(target)
        files, provenance = raw_files(data, cache_dir)
        return preprocess(files, data, target, provenance={"dataset": data.name, **provenance})


def example_rows(data: DataConfig, cache_dir: str | os.PathLike, n: int = 5) -> pd.DataFrame:
    """The first ``n`` raw rows of the dataset's first file, label excluded, as a DataFrame of the
    columns a model reads (an MLflow input example)."""
    from pipeline.data.other_readers import open_reader

    files, _ = raw_files(data, cache_dir)
    first = next(iter(files.values()))[0] if isinstance(files, dict) else files[0]
    table = next(iter(open_reader([first], data, 1 << 16, "error", "example rows"))).slice(0, n)
    return table.drop_columns([data.label]).to_pandas()
