"""From a reader's typed block to the features of a dataset declaration (:mod:`pipeline.data.dataset`).

* numeric: the source column as float32 (NaN = missing), transformed later (pass 2);
* categorical: the source column's strings (null = missing), or a derivation of a time column
  (:mod:`pipeline.data.derive`);
* sequence: the values of each row — the source string split at ``separator`` (empty pieces dropped), or
  a list column — cut to ``max_length`` (rows cut are counted; ``too_long: error`` stops instead).
  A row without values gets one missing value, so every bag holds at least one id (the missing id,
  which has an embedding of its own like a missing categorical value). Returned flat, with the
  lengths per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from pipeline.data.dataset import DataConfig, FeatureDecl
from pipeline.data.derive import BadValue, derive, parse_times
from pipeline.runtime.errors import BadInputError

Where = Callable[[int], str]  # row of the block → "file:line"


@dataclass
class FeatureBlock:
    """One block of rows as features: ``sparse[j]`` holds the values of sparse feature j
    (``data.categorical`` then ``data.sequence``), ``lengths[j]`` its bag sizes (None: one per row)."""

    label: np.ndarray                 # int8 [n]
    numeric: np.ndarray               # float32 [n, numeric features], NaN = missing
    sparse: list[pa.Array]            # strings; null = missing
    lengths: list[np.ndarray | None]  # int32 [n] for sequence features
    time: np.ndarray | None = None    # int64 [n] seconds since 1970 (``data.time``), else None

    @property
    def rows(self) -> int:
        return len(self.label)


def sparse_features(data: DataConfig) -> list[FeatureDecl]:
    """The sparse features in store order: categorical ones, then sequence ones (each in declaration order)."""
    decls = data.declared()
    return [f for f in decls if f.type == "categorical"] + [f for f in decls if f.type == "sequence"]


def _categorical(column: pa.Array, decl: FeatureDecl, where: Where) -> pa.Array:
    column = pc.cast(column, pa.string())
    if decl.derive is None:
        return column
    try:
        return derive(column, decl.derive, decl.time_format)
    except BadValue as e:
        raise BadInputError(f"{where(e.index)}: column {decl.source!r} has {e.value!r}; expected {e.expected} "
                            f"(feature {decl.name!r}, derive: {decl.derive})") from None


def _sequence(column: pa.Array, decl: FeatureDecl, where: Where, truncated: dict[str, int]) -> tuple[np.ndarray, pa.Array]:
    n = len(column)
    lists = column if pat.is_list(column.type) else pc.split_pattern(pc.cast(column, pa.string()), decl.separator)
    flat = pc.cast(pc.list_flatten(lists), pa.string())
    parents = pc.list_parent_indices(lists).to_numpy()
    keep = pc.fill_null(pc.greater(pc.utf8_length(flat), 0), False).to_numpy(zero_copy_only=False)
    if not keep.all():
        flat, parents = flat.filter(pa.array(keep)), parents[keep]
    lengths = np.bincount(parents, minlength=n)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(len(parents)) - starts[parents]  # position of each value in its row
    if decl.max_length is not None and lengths.max(initial=0) > decl.max_length:
        too = lengths > decl.max_length
        if decl.too_long == "error":
            i = int(np.argmax(too))
            raise BadInputError(f"{where(i)}: column {decl.source!r} has {lengths[i]} values; expected at most "
                                f"max_length={decl.max_length} (feature {decl.name!r}; too_long: truncate keeps the first)")
        truncated[decl.name] = truncated.get(decl.name, 0) + int(too.sum())
        cut = pos < decl.max_length
        flat, parents, pos = flat.filter(pa.array(cut)), parents[cut], pos[cut]
        lengths = np.minimum(lengths, decl.max_length)
    bags = np.maximum(lengths, 1)  # an empty row: one missing value
    take = np.full(int(bags.sum()), len(flat), dtype=np.int64)  # index len(flat): the null appended below
    take[(np.cumsum(bags) - bags)[parents] + pos] = np.arange(len(flat))
    values = pc.take(pa.concat_arrays([flat, pa.nulls(1, pa.string())]), pa.array(take))
    return bags.astype(np.int32), values


def extract(table: pa.Table, data: DataConfig, where: Where, truncated: dict[str, int]) -> FeatureBlock:
    """The features of one block (module docstring); ``truncated`` counts the rows cut per sequence feature."""
    n = table.num_rows
    numeric = [f for f in data.declared() if f.type == "numeric"]
    dense = np.empty((n, len(numeric)), np.float32)
    for j, f in enumerate(numeric):
        dense[:, j] = pc.fill_null(table.column(f.source), float("nan")).to_numpy()
    sparse, lengths = [], []
    for f in sparse_features(data):
        column = table.column(f.source).combine_chunks()
        if f.type == "sequence":
            bags, values = _sequence(column, f, where, truncated)
            sparse.append(values)
            lengths.append(bags)
        else:
            sparse.append(_categorical(column, f, where))
            lengths.append(None)
    label = table.column(data.label).to_numpy().astype(np.int8) if data.label else np.zeros(n, np.int8)
    return FeatureBlock(label, dense, sparse, lengths, None if data.time is None else _times(table, data, where))


def _times(table: pa.Table, data: DataConfig, where: Where) -> np.ndarray:
    """``data.time``: each row's time in seconds since 1970 (int64); a missing or unreadable time is bad input."""
    column = table.column(data.time).combine_chunks()
    expected = f"a time (time_format: {data.time_format})"
    try:
        seconds = pc.cast(parse_times(column, data.time_format), pa.int64())
    except BadValue as e:
        raise BadInputError(f"{where(e.index)}: column {data.time!r} has {e.value!r}; expected {e.expected} "
                            f"(data.time)") from None
    if seconds.null_count:
        i = int(np.argmax(pc.is_null(seconds).to_numpy(zero_copy_only=False)))
        raise BadInputError(f"{where(i)}: column {data.time!r} is empty; expected {expected} in every row (data.time)")
    out = seconds.to_numpy()
    if (out < 0).any():
        i = int(np.argmax(out < 0))
        raise BadInputError(f"{where(i)}: column {data.time!r} has {column[i].as_py()!r}; expected {expected} "
                            f"not before 1970 (data.time)")
    return out
