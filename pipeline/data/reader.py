"""Streaming, multi-threaded reading of raw CTR files with a bad-input policy.

Each file (``.gz`` decompressed on the fly) is cut into newline-aligned chunks of about
``block_size`` bytes; each chunk is parsed by pyarrow's multi-threaded ``read_csv`` straight into
typed columns of the dataset's declaration (:mod:`pipeline.data.dataset`) — the label → int64,
numeric columns → float64, the columns of categorical and sequence features → UTF-8 strings (empty
= missing). Only a chunk that fails there is parsed again in careful mode (raw bytes, validated
column by column here). Memory is bounded by one chunk; line numbers are exact (newlines are
counted per chunk). Quoted fields must not contain newlines (such a file is refused at that line).

Bad input — a row with the wrong number of columns, a non-number in a numeric column, bytes
that are not UTF-8, a label other than 0/1, an empty file — is handled by ``policy``:

* ``error`` (default): stop with a :class:`BadInputError` naming the file, the line, the column,
  the offending value and what was expected;
* ``skip``: drop such rows and count them per reason (:attr:`RawReader.skipped`); a row with the wrong
  column count in a chunk with non-UTF-8 bytes is refused as under ``error`` (pyarrow cannot hand it over).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from tqdm import tqdm

from pipeline.data.dataset import DataConfig
from pipeline.data.raw_files import first_fields, open_lines
from pipeline.runtime.errors import BadInputError, MissingColumnsError

POLICIES = ("error", "skip")
INT_PATTERN = r"^[+-]?[0-9]+$"
NUMBER_PATTERN = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"


@dataclass
class SkipCounts:
    wrong_column_count: int = 0
    not_a_number: int = 0
    not_utf8: int = 0
    label_not_0_1: int = 0

    @property
    def total(self) -> int:
        return self.wrong_column_count + self.not_a_number + self.not_utf8 + self.label_not_0_1

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("wrong_column_count", "not_a_number", "not_utf8", "label_not_0_1")}


def _newlines(chunk: memoryview) -> int:
    return int(np.count_nonzero(np.frombuffer(chunk, dtype=np.uint8) == 10))


@dataclass
class RawReader:
    """Iterates typed record batches of ``files`` (see module docstring)."""

    files: Sequence[Path]
    data: DataConfig
    block_size: int = 32 << 20
    policy: str = "error"
    desc: str = "read"
    skipped: SkipCounts = field(default_factory=SkipCounts)
    position: tuple[Path, int] = (Path(), 0)  # file and line of the first row of the block last yielded
    _names: list[str] = field(default_factory=list)

    def where(self, index: int) -> str:
        """``file:line`` of row ``index`` of the block last yielded (exact unless rows were skipped)."""
        return f"{self.position[0]}:{self.position[1] + index}"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"data.bad_rows={self.policy!r}: expected one of {POLICIES}")
        self.files = [Path(f) for f in self.files]

    # -- validation ------------------------------------------------------------------------------
    def _fail(self, path: Path, line: int, column: str, value: bytes | str, expected: str) -> None:
        shown = value if isinstance(value, str) else value.decode("utf-8", "backslashreplace")
        raise BadInputError(f"{path}:{line}: column {column!r} has {shown!r}; expected {expected}")

    def _line_of(self, rows_before: int, index: int) -> int:
        return int(self.data.header) + rows_before + index + 1

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

    def _as_label(self, path: Path, rows_before: int, name: str, col: pa.Array) -> tuple[pa.Array, np.ndarray, np.ndarray]:
        """Text → int64 labels; returns them, the rows that are not integers and those not 0/1."""
        ok = pc.fill_null(pc.match_substring_regex(col, INT_PATTERN), True).to_numpy(zero_copy_only=False)
        bad = ~ok
        short = pc.if_else(pc.less_equal(pc.utf8_length(col), 3), col, pa.scalar(None, pa.string()))
        values = pc.cast(pc.if_else(pa.array(bad), pa.scalar(None, pa.string()), short), pa.int64())
        labels = pc.fill_null(values, -1).to_numpy(zero_copy_only=False)
        not01 = ((labels != 0) & (labels != 1)) & ~bad
        if (bad | not01).any() and self.policy == "error":
            i = int(np.argmax(bad | not01))
            self._fail(path, self._line_of(rows_before, i), name, col[i].as_py() or "", "0 or 1")
        return values, bad, not01

    def _as_number(self, path: Path, rows_before: int, name: str, col: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """Text → float64 (empty = missing); returns the column and a mask of rows that are not numbers."""
        ok = pc.fill_null(pc.match_substring_regex(col, NUMBER_PATTERN), True).to_numpy(zero_copy_only=False)
        bad = ~ok
        if bad.any() and self.policy == "error":
            i = int(np.argmax(bad))
            self._fail(path, self._line_of(rows_before, i), name, col[i].as_py() or "", "a number or nothing")
        clean = pc.if_else(pa.array(bad), pa.scalar(None, pa.string()), col) if bad.any() else col
        return pc.cast(clean, pa.float64()), bad

    def _typed(self, path: Path, rows_before: int, batch: pa.Table) -> pa.Table:
        d = self.data
        out: dict[str, pa.Array] = {}
        drop = np.zeros(batch.num_rows, dtype=bool)
        for name in d.read_columns:
            text, bad = self._as_text(path, rows_before, name, batch.column(name).combine_chunks())
            self.skipped.not_utf8 += int((bad & ~drop).sum())
            drop |= bad
            if name == d.label:
                out[name], bad, not01 = self._as_label(path, rows_before, name, text)
                self.skipped.label_not_0_1 += int((not01 & ~drop).sum())
                drop |= not01
            elif name in d.number_columns:
                out[name], bad = self._as_number(path, rows_before, name, text)
            else:
                out[name] = text
                continue
            self.skipped.not_a_number += int((bad & ~drop).sum())
            drop |= bad
        table = pa.table(out)
        return table.filter(pa.array(~drop)) if drop.any() else table

    # -- reading ---------------------------------------------------------------------------------
    def _chunks(self, path: Path, bar: tqdm) -> Iterator[tuple[memoryview, int]]:
        """Newline-aligned chunks of the file's data lines, with the byte offset where each starts.

        One reusable buffer: the unfinished last line of a chunk moves to its front, the next read
        fills the rest. A chunk is only valid until the next one is requested.
        """
        buf = bytearray(self.block_size)
        view = memoryview(buf)
        filled = 0
        offset = 0
        with open_lines(path) as fh:
            if self.data.header:
                offset = len(fh.readline())
                bar.update(offset)
            while True:
                if filled == len(buf):  # a single line longer than the buffer: grow it
                    buf.extend(bytes(len(buf)))
                    view = memoryview(buf)
                got = fh.readinto(view[filled:])
                bar.update(got or 0)
                if not got:
                    if filled:
                        yield view[:filled], offset
                    return
                filled += got
                cut = buf.rfind(b"\n", 0, filled)
                if cut < 0:
                    continue
                yield view[:cut + 1], offset
                offset += cut + 1
                rest = filled - cut - 1
                buf[:rest] = buf[cut + 1:filled]
                filled = rest

    def _header(self, path: Path) -> list[str]:
        names = first_fields(path, self.data.delimiter)
        missing = [c for c in self.data.read_columns if c not in names]
        if missing:
            raise MissingColumnsError(f"{path}:1: the header lacks column{'s' * (len(missing) > 1)} "
                                f"{', '.join(map(repr, missing))} (declared in data={self.data.name}); the file has "
                                f"{names[:60]}")
        return names

    def _parse(self, chunk: memoryview, names: list[str], careful: bool, bad_rows: list[str]) -> pa.Table:
        d = self.data

        def invalid_row(row: pacsv.InvalidRow) -> str:
            bad_rows.append(row.text)
            return "skip"

        # pyarrow decodes a row's text before calling the handler and cannot raise that failure ("unraisable"):
        # the handler is for UTF-8 chunks; elsewhere the bad row fails the parse (fast → careful → file:line)
        handler = invalid_row if careful and _is_utf8(chunk) else None
        types = {c: pa.binary() for c in d.read_columns} if careful else \
            {c: pa.int64() if c == d.label else pa.float64() if c in d.number_columns else pa.string()
             for c in d.read_columns}
        return pacsv.read_csv(
            pa.py_buffer(chunk),
            read_options=pacsv.ReadOptions(column_names=names, use_threads=True, block_size=1 << 20),
            parse_options=pacsv.ParseOptions(delimiter=d.delimiter, quote_char=d.quoting,
                                             invalid_row_handler=handler, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(d.read_columns),
                                                 strings_can_be_null=True))

    @staticmethod
    def _first_line(chunk: memoryview, bad: Callable[[bytes], bool]) -> tuple[int, bytes] | None:
        """(index, text without the line end) of the chunk's first line for which ``bad`` holds."""
        for i, text in enumerate(bytes(chunk).split(b"\n")):
            if bad(text.rstrip(b"\r")):
                return i, text.rstrip(b"\r")
        return None

    def _wrong_column_count(self, path: Path, chunk: memoryview, first_line: int) -> BadInputError | None:
        """The error for the chunk's first line with a column count other than the layout's (None: none)."""
        n = len(self._names)
        delim = self.data.delimiter.encode()
        hit = self._first_line(chunk, lambda text: text.count(delim) + 1 != n)
        if hit is None:
            return None
        i, text = hit
        found = text.count(delim) + 1
        other = max((d for d in (b",", b"\t", b";", b"|") if d != delim), key=text.count)
        hint = f"; it splits into {text.count(other) + 1} columns at {other.decode()!r}: a file of " \
            f"another layout?" if found == 1 and text.count(other) else ""
        return BadInputError(f"{path}:{first_line + i}: {found} column{'s' * (found != 1)}, expected {n} "
                             f"(data={self.data.name}, separated by {self.data.delimiter!r}){hint}; "
                             f"the line reads {text[:120].decode('utf-8', 'backslashreplace')!r}")

    def _column_count_error(self, path: Path, chunk: memoryview, first_line: int) -> BadInputError:
        return self._wrong_column_count(path, chunk, first_line) or \
            BadInputError(f"{path}: a row has the wrong number of columns (expected {len(self._names)})")

    def _unparsable(self, path: Path, chunk: memoryview, first_line: int, err: Exception) -> BadInputError:
        return self._wrong_column_count(path, chunk, first_line) or \
            BadInputError(f"{path}:{first_line}: cannot be parsed as data={self.data.name} rows ({err})")

    def _quoted_newline_error(self, path: Path, chunk: memoryview, first_line: int) -> BadInputError:
        quote = str(self.data.quoting).encode()
        hit = self._first_line(chunk, lambda text: text.count(quote) % 2 == 1)
        return BadInputError(f"{path}:{first_line + (hit[0] if hit else 0)}: a quoted value runs over a line break "
                             f"(quoted values must fit on one line)")

    def _fast_ok(self, table: pa.Table) -> bool:
        """A typed chunk needs the careful path if a label is missing or not 0/1."""
        if table.num_rows == 0 or not self.data.label:  # every row was cut by its column count / no label
            return True
        label = table.column(self.data.label)
        return not (label.null_count or pc.max(label).as_py() > 1 or pc.min(label).as_py() < 0)

    def _file_tables(self, path: Path, bar: tqdm) -> Iterator[pa.Table]:
        d = self.data
        if os.path.getsize(path) == 0:
            raise BadInputError(f"{path}: the file is empty (expected data={d.name} rows)")
        names = self._names = self._header(path) if d.header else list(d.columns or ())
        line = 1 + int(d.header)
        for chunk, offset in self._chunks(path, bar):
            first, lines = line, _newlines(chunk)
            self.position = (path, first)  # where the block's first row is (for later errors about its values)
            line += lines
            bad_rows: list[str] = []
            try:
                table = self._parse(chunk, names, careful=False, bad_rows=bad_rows)
                careful = not self._fast_ok(table)
            except pa.ArrowInvalid:
                careful = True
            if careful:
                bad_rows = []
                try:
                    table = self._parse(chunk, names, careful=True, bad_rows=bad_rows)
                except pa.ArrowInvalid as e:  # e.g. a lone line that pyarrow rejects before the row handler
                    raise self._unparsable(path, chunk, first, e) from None
            if d.quoting and table.num_rows + len(bad_rows) != lines + (chunk[-1:] != b"\n"):
                raise self._quoted_newline_error(path, chunk, first)
            if bad_rows:
                if self.policy == "error":
                    raise self._column_count_error(path, chunk, first)
                self.skipped.wrong_column_count += len(bad_rows)
            if careful:
                # rows skipped for their column count shift later rows' line numbers only under "skip"
                table = self._typed(path, first - 1 - int(d.header), table)
            yield table

    def __iter__(self) -> Iterator[pa.Table]:
        total = sum(os.path.getsize(f) for f in self.files)
        with tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, leave=False,
                  disable=None) as bar:  # (None: a bar on a terminal only, never in a log file)
            for path in self.files:
                yield from self._file_tables(path, bar)


def _is_utf8(chunk: memoryview) -> bool:
    try:
        str(chunk, "utf-8")
    except UnicodeDecodeError:
        return False
    return True
