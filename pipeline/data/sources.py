"""Where a dataset's raw files come from, and the cached store built from them.

A store lives at ``<cache_dir>/stores/<name>-<fingerprint>``; the fingerprint hashes what
determines its content (the generator config or the raw files' path/size/mtime, and the
preprocessing config), so a second run with the same inputs reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional

from pipeline.data.preprocess import PreprocessConfig, preprocess
from pipeline.data.schema import SCHEMAS, Schema
from pipeline.data.store import FORMAT_VERSION, SPLITS, ColumnarStore
from pipeline.data.synthetic import SyntheticConfig, generate


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class DataConfig:
    """``data`` (``conf/data/*.yaml``): a dataset, its raw files and how they are preprocessed."""

    name: str = "synthetic"
    schema: str = "criteo"             # column layout of the raw files (pipeline.data.schema)
    path: Any = None                   # a file, a list of files, or a mapping split → file(s)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # name 'synthetic': the generator
    shape_only: bool = False           # planning only (python -m pipeline.plan): no file, tables from
    cardinalities: Optional[List[int]] = None  # these distinct-value counts and
    zipf_exponent: float = 1.1         # this id-frequency model

    def __post_init__(self) -> None:
        if self.schema not in SCHEMAS:
            raise ValueError(f"schema={self.schema!r}: expected one of {sorted(SCHEMAS)}")

    @property
    def layout(self) -> Schema:
        return SCHEMAS[self.schema]

    @property
    def generated(self) -> bool:
        return self.name == "synthetic"


def _paths(data: DataConfig) -> list[Path] | dict[str, list[Path]]:
    """``data.path``: a file, a list of files, or a mapping split → file(s) (the dataset's own split)."""
    raw = data.path
    if raw in (None, "", "???") or (isinstance(raw, Mapping) and not raw):
        raise ValueError(f"data.path is missing: set data.path=<file> (a {data.schema}-format file) "
                         f"for data={data.name}")

    def files(value: Any, key: str) -> list[Path]:
        if value in (None, "", "???"):
            raise ValueError(f"{key} is missing: expected a {data.schema}-format file")
        paths = [Path(str(p)).expanduser() for p in (value if isinstance(value, (list, tuple)) else [value])]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"{key}: {p} does not exist or is not a file "
                                        f"(expected a {data.schema}-format file)")
        return paths

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
    paths = _paths(data)
    described = {split: [_describe(p) for p in group] for split, group in paths.items()} \
        if isinstance(paths, dict) else [_describe(p) for p in paths]
    return {"files": described}


def _describe(p: Path) -> dict[str, Any]:
    st = p.stat()
    return {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def store_dir(data: DataConfig, cache_dir: str | os.PathLike) -> Path:
    key = {"format": FORMAT_VERSION, "schema": data.schema, "raw": raw_fingerprint(data),
           "preprocess": asdict(data.preprocess)}
    return Path(cache_dir) / "stores" / f"{data.name}-{_digest(key)}"


def raw_files(data: DataConfig, cache_dir: str | os.PathLike) -> tuple[list[Path] | dict[str, list[Path]], dict[str, Any]]:
    """The raw files (generating the synthetic one if needed) and a provenance record."""
    if not data.generated:
        return _paths(data), raw_fingerprint(data)
    cfg = data.synthetic
    path = Path(cache_dir) / "raw" / f"synthetic-{_digest(asdict(cfg))}.tsv"
    summary_path = Path(str(path) + ".json")
    if not (path.is_file() and summary_path.is_file()):
        generate(cfg, path)
    summary = json.loads(summary_path.read_text())
    return [path], {"synthetic_file": str(path), **{k: v for k, v in summary.items() if k != "config"}}


def prepare_store(data: DataConfig, cache_dir: str | os.PathLike) -> ColumnarStore:
    """Return the store for ``data``, building it (and the raw data) on first use."""
    target = store_dir(data, cache_dir)
    if (target / "meta.json").is_file():
        return ColumnarStore(target)
    files, provenance = raw_files(data, cache_dir)
    return preprocess(files, data.layout, data.preprocess, target, provenance={"dataset": data.name, **provenance})
