"""Streaming, multi-threaded reading of raw CTR files with a bad-input policy.

Files are parsed in blocks by pyarrow's CSV reader (``.gz`` files are decompressed on the fly),
every column first as raw bytes; each block is then validated and typed here: label → int8,
integer (dense) columns → int64, categorical columns → UTF-8 strings (empty = missing).

Bad input — a row with the wrong number of columns, a non-integer in an integer column, bytes
that are not UTF-8, an empty file — is handled by ``policy``:

* ``error`` (default): stop with a :class:`BadInputError` naming the file, the line, the column,
  the offending value and what was expected;
* ``skip``: drop such rows and count them per reason (:attr:`RawReader.skipped`).

Line numbers are exact: the reader tracks the rows of each file, and only on an error scans the
file (from the last good row) to find the offending line.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from tqdm import tqdm

from pipeline.data.schema import Schema

POLICIES = ("error", "skip")
INT_PATTERN = r"^[+-]?[0-9]+$"


class BadInputError(ValueError):
    """A raw file that does not match its declared layout."""


@dataclass
class SkipCounts:
    wrong_column_count: int = 0
    not_an_integer: int = 0
    not_utf8: int = 0
    label_not_0_1: int = 0

    @property
    def total(self) -> int:
        return self.wrong_column_count + self.not_an_integer + self.not_utf8 + self.label_not_0_1

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("wrong_column_count", "not_an_integer", "not_utf8", "label_not_0_1")}


class _ProgressFile(io.RawIOBase):
    """Binary file wrapper that reports bytes read to a tqdm bar."""

    def __init__(self, path: Path, bar: tqdm) -> None:
        self._f = open(path, "rb")
        self._bar = bar

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self._f.readinto(b)
        self._bar.update(n or 0)
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_lines(path: Path):
    if str(path).endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def _scan_for_line(path: Path, start_line: int, bad: Callable[[bytes], bool]) -> tuple[int, bytes] | None:
    """First line at or after ``start_line`` (1-based) for which ``bad(line)``; slow path for errors."""
    with _open_lines(path) as fh:
        for number, line in enumerate(fh, start=1):
            if number >= start_line and bad(line.rstrip(b"\r\n")):
                return number, line.rstrip(b"\r\n")
    return None


@dataclass
class RawReader:
    """Iterates typed record batches of ``files`` (see module docstring)."""

    files: Sequence[Path]
    schema: Schema
    block_size: int = 32 << 20
    policy: str = "error"
    desc: str = "read"
    skipped: SkipCounts = field(default_factory=SkipCounts)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"data.bad_rows={self.policy!r}: expected one of {POLICIES}")
        self.files = [Path(f) for f in self.files]

    # -- validation ------------------------------------------------------------------------------
    def _fail(self, path: Path, line: int, column: str, value: bytes | str, expected: str) -> None:
        shown = value if isinstance(value, str) else value.decode("utf-8", "backslashreplace")
        raise BadInputError(f"{path}:{line}: column {column!r} has {shown!r}; expected {expected}")

    def _line_of(self, rows_before: int, index: int) -> int:
        return int(self.schema.header) + rows_before + index + 1

    def _as_text(self, path: Path, rows_before: int, name: str, col: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """Binary column → UTF-8 strings; returns the column and a mask of rows that are not UTF-8."""
        try:
            return pc.cast(col, pa.string()), np.zeros(len(col), dtype=bool)
        except pa.ArrowInvalid:
            bad = np.zeros(len(col), dtype=bool)
            for i, v in enumerate(col.to_pylist()):
                if v is not None:
                    try:
                        v.decode("utf-8")
                    except UnicodeDecodeError:
                        if self.policy == "error":
                            self._fail(path, self._line_of(rows_before, i), name, v, "UTF-8 text")
                        bad[i] = True
            fixed = pa.array([None if b else v for v, b in zip(col.to_pylist(), bad)], type=pa.binary())
            return pc.cast(fixed, pa.string()), bad

    def _as_int(self, path: Path, rows_before: int, name: str, col: pa.Array, expected: str) -> tuple[pa.Array, np.ndarray]:
        nullable = name in self.schema.dense or name == self.schema.label  # a missing label is caught later
        ok = pc.fill_null(pc.match_substring_regex(col, INT_PATTERN), nullable).to_numpy(zero_copy_only=False)
        bad = ~ok
        if bad.any() and self.policy == "error":
            i = int(np.argmax(bad))
            self._fail(path, self._line_of(rows_before, i), name, col[i].as_py() or "", expected)
        clean = pc.if_else(pa.array(bad), pa.scalar(None, pa.string()), col) if bad.any() else col
        return pc.cast(clean, pa.int64()), bad

    def _typed(self, path: Path, rows_before: int, batch: pa.RecordBatch) -> tuple[pa.Table, int]:
        s = self.schema
        out: dict[str, pa.Array] = {}
        drop = np.zeros(batch.num_rows, dtype=bool)
        for name in s.read_columns:
            text, bad = self._as_text(path, rows_before, name, batch.column(name))
            self.skipped.not_utf8 += int((bad & ~drop).sum())
            drop |= bad
            if name in s.int_columns:
                expected = "0 or 1" if name == s.label else "an integer" if name not in s.dense else "an integer or nothing"
                values, bad = self._as_int(path, rows_before, name, text, expected)
                if name == s.label:
                    missing = values.is_null().to_numpy(zero_copy_only=False)
                    labels = pc.fill_null(values, -1).to_numpy(zero_copy_only=False)
                    not01 = (labels != 0) & (labels != 1) & ~bad
                    if not01.any() and self.policy == "error":
                        i = int(np.argmax(not01 | missing))
                        self._fail(path, self._line_of(rows_before, i), name, text[i].as_py() or "", expected)
                    self.skipped.label_not_0_1 += int((not01 & ~drop).sum())
                    drop |= not01
                self.skipped.not_an_integer += int((bad & ~drop).sum())
                drop |= bad
                out[name] = values
            else:
                out[name] = text
        table = pa.table(out)
        if drop.any():
            table = table.filter(pa.array(~drop))
        return (s.derive(table) if s.derive else table), int(drop.sum())

    # -- reading ---------------------------------------------------------------------------------
    def _file_batches(self, path: Path, bar: tqdm) -> Iterator[pa.Table]:
        s = self.schema
        if os.path.getsize(path) == 0:
            raise BadInputError(f"{path}: the file is empty (expected {s.name}-format rows)")
        pending_error: list[int] = []

        def invalid_row(row: pacsv.InvalidRow) -> str:
            if self.policy == "skip":
                self.skipped.wrong_column_count += 1
                return "skip"
            pending_error.append(row.actual_columns)
            return "error"

        src = _ProgressFile(path, bar)
        stream: pa.NativeFile = pa.PythonFile(src, mode="r")
        if str(path).endswith(".gz"):
            stream = pa.CompressedInputStream(stream, "gzip")
        rows_before = 0
        try:
            if s.header:
                with _open_lines(path) as fh:
                    names = fh.readline().rstrip(b"\r\n").decode("utf-8", "backslashreplace").split(s.delimiter)
                names = [n.strip('"') for n in names]
                missing = [c for c in s.read_columns if c not in names]
                if missing:
                    raise BadInputError(f"{path}:1: the header lacks columns {missing}; expected {list(s.columns)}")
            reader = pacsv.open_csv(
                stream,
                read_options=pacsv.ReadOptions(column_names=None if s.header else list(s.columns),
                                               block_size=self.block_size, use_threads=True),
                parse_options=pacsv.ParseOptions(delimiter=s.delimiter, quote_char=s.quote_char,
                                                 invalid_row_handler=invalid_row, ignore_empty_lines=False),
                convert_options=pacsv.ConvertOptions(column_types={c: pa.binary() for c in s.read_columns},
                                                     include_columns=list(s.read_columns), strings_can_be_null=True),
            )
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except pa.ArrowInvalid as e:
                    if pending_error:
                        self._raise_column_count(path, rows_before, e)
                    raise BadInputError(f"{path}: cannot be parsed as {s.name}-format rows: {e}") from e
                table, _ = self._typed(path, rows_before, batch)
                rows_before += batch.num_rows
                yield table
        except pa.ArrowInvalid as e:
            if pending_error:
                self._raise_column_count(path, rows_before, e)
            raise BadInputError(f"{path}: cannot be parsed as {s.name}-format rows: {e}") from e
        finally:
            src.close()

    def _raise_column_count(self, path: Path, rows_before: int, cause: Exception) -> None:
        n = len(self.schema.columns)
        delim = self.schema.delimiter.encode()
        found = _scan_for_line(path, self._line_of(rows_before, 0), lambda line: line.count(delim) + 1 != n)
        if found is None:
            raise BadInputError(f"{path}: a row has the wrong number of columns (expected {n}): {cause}") from cause
        line, text = found
        shown = text[:120].decode("utf-8", "backslashreplace")
        raise BadInputError(f"{path}:{line}: {text.count(delim) + 1} columns, expected {n} "
                            f"({self.schema.name} layout); the line reads {shown!r}") from cause

    def __iter__(self) -> Iterator[pa.Table]:
        total = sum(os.path.getsize(f) for f in self.files)
        with tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, leave=False) as bar:
            for path in self.files:
                yield from self._file_batches(path, bar)
