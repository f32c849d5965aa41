"""A dataset declared in configuration (``conf/data/*.yaml``): its files, its label and its features.

    name: mylog
    format: csv                  # csv | tsv | parquet | libsvm   (csv/tsv may be .gz)
    path: ???                    # a file, a list, a directory or glob, or {train: ..., valid: ..., test: ...}
    header: true                 # csv/tsv: the first line names the columns; else `columns: [...]` does
    label: clicked               # 0/1 column
    features:                    # columns not listed are ignored
      - {name: user_id,  type: categorical}
      - {name: price,    type: numeric, transform: log1p}                        # log1p | minmax | none
      - {name: tags,     type: sequence, separator: "|", max_length: 50, pooling: mean}   # sum | mean
      - {name: hist_items, type: sequence, separator: ",", share_table_with: item_id}
      - {name: hour, column: click_time, type: categorical, derive: hour_of_day}  # hour_of_day | weekday | date
    time: click_time             # optional: the column of each row's time (iso | unix | a strptime pattern, as
    time_format: iso             #   `time_format`), kept in the store: the clock of model.zch.ttl_clock=time

Feature types: ``categorical`` — one id per row (one embedding row looked up); ``sequence`` — a
multi-hot bag of ids per row (the embeddings are pooled by sum or mean); ``numeric`` — a number
(transformed, fed to the dense side). ``column`` names the file column a feature reads (default: its
name), so one column can feed several features. ``share_table_with`` makes a feature read another
feature's embedding table (one vocabulary, counted over both). ``libsvm`` files (``label idx:val ...``)
give one sequence feature ``features`` with every index of a row, or, with ``index_range: [lo, hi)``
per declared feature, a feature per index range (field-aware); the values are ignored (indicator
features, as public CTR sets in that format ship them).

Criteo, Avazu and Frappe are instances of this declaration (``conf/layout/*.yaml``), not code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf

from pipeline.data.preprocess_config import PreprocessConfig
from pipeline.data.synthetic import SyntheticConfig

FORMATS = ("csv", "tsv", "parquet", "libsvm")
TYPES = ("categorical", "numeric", "sequence")
TRANSFORMS = ("log1p", "minmax", "none")
POOLINGS = ("sum", "mean")
DERIVATIONS = ("hour_of_day", "weekday", "date")
TOO_LONG = ("truncate", "error")
DEFAULT_SEPARATORS = {"csv": ",", "tsv": "\t"}
LIBSVM_FEATURE = "features"
LAYOUTS_DIR = Path(__file__).resolve().parents[2] / "conf" / "layout"


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: expected one of {list(allowed)}")


@dataclass
class FeatureDecl:
    """One entry of ``data.features``."""

    name: str = MISSING
    type: str = "categorical"           # categorical | numeric | sequence
    column: Optional[str] = None        # the file column read (default: name)
    transform: str = "log1p"            # numeric: log1p (of max(x, 0)) | minmax (training range → [0, 1]) | none
    separator: Optional[str] = None     # sequence in a text column: what separates its values
    max_length: Optional[int] = None    # sequence: longest bag kept
    too_long: str = "truncate"          # a longer sequence: truncate (and count) | error
    pooling: str = "sum"                # sequence: sum | mean of its embeddings
    share_table_with: Optional[str] = None  # read this other feature's embedding table
    derive: Optional[str] = None        # categorical from a time column: hour_of_day | weekday | date
    time_format: str = "iso"            # derive: iso (2017-11-07 09:30:38) | unix (seconds) | a strptime pattern
    index_range: Optional[List[int]] = None  # libsvm: the feature's indices [lo, hi)

    def __post_init__(self) -> None:
        _one_of("type", self.type, TYPES)
        _one_of("transform", self.transform, TRANSFORMS)
        _one_of("pooling", self.pooling, POOLINGS)
        _one_of("too_long", self.too_long, TOO_LONG)
        if self.derive is not None:
            _one_of("derive", self.derive, DERIVATIONS)
            if self.type != "categorical":
                raise ValueError(f"derive={self.derive!r}: derivations make categorical features, not {self.type}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length={self.max_length}: expected a positive length or null")
        if self.share_table_with is not None and self.type == "numeric":
            raise ValueError("share_table_with: a numeric feature has no embedding table")
        if self.index_range is not None and (len(self.index_range) != 2 or self.index_range[0] >= self.index_range[1]):
            raise ValueError(f"index_range={list(self.index_range)}: expected [lo, hi) with lo < hi")

    @property
    def source(self) -> str:
        return self.column or self.name

    @property
    def sparse(self) -> bool:
        return self.type != "numeric"


@dataclass
class DataConfig:
    """``data``: a dataset — its files, layout and features (module docstring) — and its preprocessing."""

    name: str = "synthetic"
    format: str = "tsv"
    path: Any = None                   # a file, a list, a directory or glob, or a mapping split → file(s)
    header: bool = False               # csv/tsv: the first line names the columns
    columns: Optional[List[str]] = None  # csv/tsv without a header: the column names, in order
    separator: Optional[str] = None    # csv/tsv field separator (default ',' / tab)
    quote_char: Optional[str] = None   # csv/tsv quoting (default '"' for csv, none for tsv; '' = none)
    label: str = "label"               # '' only for rows to score (pipeline.commands.predict): no label column
    time: Optional[str] = None         # a column of each row's time, kept as seconds since 1970 (int64 time.npy)
    time_format: str = "iso"           # of `time`: iso | unix | a strptime pattern (pipeline/data/derive.py)
    features: List[FeatureDecl] = field(default_factory=list)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # name 'synthetic': the generator
    shape_only: bool = False           # planning only (python -m pipeline.commands.plan): no file, tables from
    cardinalities: Optional[List[int]] = None  # these distinct-value counts and
    zipf_exponent: float = 1.1         # this id-frequency model

    def __post_init__(self) -> None:
        _one_of("format", self.format, FORMATS)
        if self.format in DEFAULT_SEPARATORS and self.features and not self.header and not self.columns:
            raise ValueError("columns is missing: a csv/tsv file without a header needs `columns: [...]` naming "
                             "its columns in order (or `header: true`)")
        names = [f.name for f in self.features]
        seen: set[str] = set()
        for i, f in enumerate(self.features):
            where = f"features[{i}]"
            if f.name in seen:
                raise ValueError(f"{where}.name={f.name!r}: declared twice")
            seen.add(f.name)
            if self.label and f.name == self.label:
                raise ValueError(f"{where}.name={f.name!r}: is the label")
            target = f.share_table_with
            if target is not None:
                decl = next((g for g in self.features if g.name == target), None)
                if decl is None or not decl.sparse or decl.share_table_with is not None or target == f.name:
                    raise ValueError(f"{where}.share_table_with={target!r}: expected a categorical or sequence "
                                     f"feature that has its own table; declared: {names}")
            if f.type == "sequence" and self.format in DEFAULT_SEPARATORS and not f.separator:
                raise ValueError(f"{where}.separator is missing: a sequence in a {self.format} column needs the "
                                 f"separator of its values (e.g. '|')")
            if self.format == "libsvm" and (f.type == "numeric" or f.index_range is None):
                raise ValueError(f"{where}: a libsvm feature is categorical or sequence with an index_range [lo, hi)")
            if self.columns and self.format in DEFAULT_SEPARATORS and f.source not in self.columns:
                raise ValueError(f"{where}: column {f.source!r} is not among columns {list(self.columns)}")
        kinds: dict[str, set[str]] = {}
        for f in self.features:
            kinds.setdefault(f.source, set()).add("number" if f.type == "numeric" else "text")
        both = sorted(c for c, k in kinds.items() if len(k) > 1)
        if both:
            raise ValueError(f"features: column {both[0]!r} is read both as numeric and as text; declare it once")
        if self.time is not None and (self.time == self.label or self.time in self.number_columns
                                      or (self.columns and self.format in DEFAULT_SEPARATORS and self.time not in self.columns)):
            raise ValueError(f"time={self.time!r}: expected a text column of times that is not the label or a numeric "
                             f"feature's column" + (f" (columns: {list(self.columns)})" if self.columns else ""))
        if self.time is not None and self.format == "libsvm":
            raise ValueError("time: a libsvm file has no named columns to read a time from")
        if self.label and self.columns and self.format in DEFAULT_SEPARATORS and self.label not in self.columns:
            raise ValueError(f"label={self.label!r}: not among columns {list(self.columns)}")

    # -- what the rest of the pipeline reads ----------------------------------------------------
    @property
    def generated(self) -> bool:
        return self.name == "synthetic"

    def declared(self) -> list[FeatureDecl]:
        """The features; libsvm without declarations: one sequence feature of all indices."""
        if self.features or self.format != "libsvm":
            return list(self.features)
        return [FeatureDecl(name=LIBSVM_FEATURE, type="sequence")]

    def of_type(self, kind: str) -> tuple[str, ...]:
        return tuple(f.name for f in self.declared() if f.type == kind)

    @property
    def numeric(self) -> tuple[str, ...]:
        return self.of_type("numeric")

    @property
    def categorical(self) -> tuple[str, ...]:
        return self.of_type("categorical")

    @property
    def sequence(self) -> tuple[str, ...]:
        return self.of_type("sequence")

    def table_of(self, feature: str) -> str:
        decl = self.decl(feature)
        return decl.share_table_with or decl.name

    def decl(self, feature: str) -> FeatureDecl:
        return next(f for f in self.declared() if f.name == feature)

    @property
    def delimiter(self) -> str:
        return self.separator or DEFAULT_SEPARATORS.get(self.format, ",")

    @property
    def quoting(self) -> str | bool:
        q = self.quote_char if self.quote_char is not None else ('"' if self.format == "csv" else "")
        return q or False

    @property
    def number_columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.source for f in self.declared() if f.type == "numeric"))

    @property
    def text_columns(self) -> tuple[str, ...]:
        """The columns read as text: the sparse features' and the time's."""
        time = (self.time,) if self.time is not None else ()
        return tuple(dict.fromkeys([*(f.source for f in self.declared() if f.type != "numeric"), *time]))

    @property
    def read_columns(self) -> tuple[str, ...]:
        """The label (unless ``label`` is empty: rows to score), then the features' columns."""
        return (*((self.label,) if self.label else ()), *self.number_columns, *self.text_columns)


def builtin_layout(name: str, preprocess: PreprocessConfig | None = None) -> DataConfig:
    """A layout of ``conf/layout/<name>.yaml`` (criteo, avazu, frappe) as a typed :class:`DataConfig`."""
    path = LAYOUTS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no layout {name!r}: expected one of {sorted(p.stem for p in LAYOUTS_DIR.glob('*.yaml'))}")
    data: DataConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(path)))
    data.name = name
    if preprocess is not None:
        data.preprocess = preprocess
    return data
