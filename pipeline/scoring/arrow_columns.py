"""Raw columns given as Arrow arrays (a ranking request's Arrow body) read without Python lists: numbers to numpy,
categories to Arrow strings; anything else passed on as it is (or as Python values where Arrow cannot convert)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.runtime.errors import BundleError


def arrow_numbers(values: Any) -> Any:
    """An Arrow numeric column as float64 numpy (null → NaN, no Python objects); anything else as it is."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)) and (pa.types.is_floating(values.type)
                                                            or pa.types.is_integer(values.type)):
        return pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    return python_values(values)


def python_values(values: Any) -> Any:
    """An Arrow column as Python values (the slow path of a column Arrow cannot convert by itself)."""
    return values.to_pylist() if isinstance(values, (pa.Array, pa.ChunkedArray)) else values


def category_strings(column: str, values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A categorical Arrow column as strings (numbers as their text), null where missing (null or "")."""
    kind = values.type.value_type if pa.types.is_dictionary(values.type) else values.type  # pandas' categoricals
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind)
            or pa.types.is_null(kind)):
        raise BundleError(f"column {column!r}: an Arrow {values.type} column where the declaration reads categories: "
                          f"send strings (or integers)")
    return empty_as_null(pc.cast(values, pa.string()))


def empty_as_null(strings: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Strings with "" (a missing value in a text file) as null."""
    empty = pc.equal(strings, "")
    return pc.if_else(empty, pa.scalar(None, pa.string()), strings) if pc.any(empty).as_py() else strings
