"""Readers of the non-delimited formats, yielding the same typed blocks as :class:`RawReader`:
the label as int64, numeric columns as float64, the columns of categorical and sequence features as
strings (a sequence column may also be a list of strings).

* ``parquet`` — read in row batches (bounded memory); a declared column the file lacks, or a column
  of a type its feature cannot take (text for a numeric feature, a float for a categorical one…), is
  an error naming the file, the column, its type and what was expected.
* ``libsvm`` / ``libfm`` — ``label idx[:val] idx[:val] …`` per line: the indices become categorical
  ids, one sequence feature ``features`` per row, or one feature per declared ``index_range``
  (field-aware); the values are ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pyarrow.types as pat
from tqdm import tqdm

from pipeline.data.reader import INT_PATTERN, RawReader
from pipeline.runtime.errors import BadInputError


def _labels(where, label: pa.Array, name: str) -> pa.Array:
    """int64 labels, each 0 or 1 (else :class:`BadInputError` at the first other value)."""
    values = pc.cast(label, pa.int64())
    ok = pc.fill_null(pc.or_(pc.equal(values, 0), pc.equal(values, 1)), False).to_numpy(zero_copy_only=False)
    if not ok.all():
        i = int(np.argmin(ok))
        raise BadInputError(f"{where(i)}: column {name!r} has {label[i].as_py()!r}; expected 0 or 1")
    return values


@dataclass
class ParquetReader(RawReader):
    """Row batches of Parquet files (module docstring)."""

    def where(self, index: int) -> str:
        return f"{self.position[0]}: row {self.position[1] + index}"

    def _check_types(self, path: Path, schema: pa.Schema) -> None:
        d = self.data
        have = {f.name: f.type for f in schema}
        missing = [c for c in d.read_columns if c not in have]
        if missing:
            raise BadInputError(f"{path}: no column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                                f"(declared in data={d.name}); the file has {list(have)[:60]}")
        sequences = {f.source for f in d.declared() if f.type == "sequence"}
        for c in d.read_columns:
            t = have[c]
            if c == d.label:
                ok, expected = pat.is_integer(t) or pat.is_boolean(t), "an integer or boolean column of 0/1"
            elif c in d.number_columns:
                ok, expected = pat.is_integer(t) or pat.is_floating(t) or pat.is_decimal(t), "a numeric column"
            else:
                inner = t.value_type if c in sequences and (pat.is_list(t) or pat.is_large_list(t)) else t
                ok = pat.is_string(inner) or pat.is_large_string(inner) or pat.is_integer(inner) \
                    or pat.is_boolean(inner)
                expected = "a string or integer column" + (" (or a list of them)" if c in sequences else "")
            if not ok:
                raise BadInputError(f"{path}: column {c!r} has type {t}; expected {expected}")

    @staticmethod
    def _as_text(column: pa.Array) -> pa.Array:
        t = column.type
        if pat.is_list(t) or pat.is_large_list(t):
            return pc.cast(column, pa.list_(pa.string()))
        return pc.cast(column, pa.string())

    def __iter__(self) -> Iterator[pa.Table]:
        d = self.data
        rows_per_batch = max(1024, self.block_size // 128)
        total = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        with tqdm(total=total, desc=self.desc, unit="rows", unit_scale=True, leave=False,
                  disable=None) as bar:  # (None: a bar on a terminal only, never in a log file)
            for path in self.files:
                try:
                    pf = pq.ParquetFile(path)
                except pa.ArrowInvalid as e:
                    raise BadInputError(f"{path}: not a Parquet file ({e})") from None
                self._check_types(path, pf.schema_arrow)
                row = 1
                for batch in pf.iter_batches(batch_size=rows_per_batch, columns=list(d.read_columns)):
                    self.position = (path, row)
                    out = {d.label: _labels(self.where, batch.column(d.label), d.label)} if d.label else {}
                    for c in d.number_columns:
                        out[c] = pc.cast(batch.column(c), pa.float64())
                    for c in d.text_columns:
                        out[c] = self._as_text(batch.column(c))
                    row += batch.num_rows
                    bar.update(batch.num_rows)
                    yield pa.table(out)


@dataclass
class LibsvmReader(RawReader):
    """``label idx[:val] …`` lines, in newline-aligned chunks (module docstring)."""

    def _lines(self, chunk: memoryview) -> pa.Array:
        table = pacsv.read_csv(
            pa.py_buffer(chunk), read_options=pacsv.ReadOptions(column_names=["line"], block_size=1 << 20),
            parse_options=pacsv.ParseOptions(delimiter="\x1f", quote_char=False, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(column_types={"line": pa.string()}, strings_can_be_null=False))
        return table.column("line").combine_chunks()

    def _block(self, lines: pa.Array) -> pa.Table:
        d = self.data
        tokens = pc.split_pattern_regex(pc.utf8_trim_whitespace(lines), r"\s+")
        label_text = pc.list_element(tokens, 0)
        ok = pc.match_substring_regex(label_text, INT_PATTERN).to_numpy(zero_copy_only=False)
        if not ok.all():
            i = int(np.argmin(ok))
            raise BadInputError(f"{self.where(i)}: label {label_text[i].as_py()!r}; expected 0 or 1 "
                                f"(libsvm: 'label idx:val idx:val ...')")
        out = {d.label: _labels(self.where, pc.cast(label_text, pa.int64()), "label")}
        rest = pc.list_slice(tokens, 1)
        flat = pc.list_flatten(rest)
        parents = pc.list_parent_indices(rest).to_numpy()
        index_text = pc.list_element(pc.split_pattern(flat, ":", max_splits=1), 0)
        good = pc.match_substring_regex(index_text, r"^[0-9]+$").to_numpy(zero_copy_only=False)
        if not good.all():
            k = int(np.argmin(good))
            raise BadInputError(f"{self.where(int(parents[k]))}: {flat[k].as_py()!r}; expected idx:value with a "
                                f"non-negative integer index")
        n = len(lines)
        if not d.features:
            out[d.declared()[0].name] = pa.ListArray.from_arrays(_offsets(parents, n), index_text)
            return pa.table(out)
        index = pc.cast(index_text, pa.int64()).to_numpy()
        for f in d.features:
            lo, hi = f.index_range
            sel = (index >= lo) & (index < hi)
            values, rows = pc.filter(index_text, pa.array(sel)), parents[sel]
            if f.type == "sequence":
                out[f.name] = pa.ListArray.from_arrays(_offsets(rows, n), values)
                continue
            counts = np.bincount(rows, minlength=n)
            if counts.max(initial=0) > 1:
                i = int(np.argmax(counts > 1))
                raise BadInputError(f"{self.where(i)}: {counts[i]} indices in [{lo}, {hi}) of categorical feature "
                                    f"{f.name!r}; expected at most one (declare it type: sequence)")
            column = np.full(n, None, dtype=object)
            column[rows] = values.to_numpy(zero_copy_only=False)
            out[f.name] = pa.array(column, pa.string())
        return pa.table(out)

    def __iter__(self) -> Iterator[pa.Table]:
        total = sum(os.path.getsize(f) for f in self.files)
        with tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, leave=False,
                  disable=None) as bar:  # (None: a bar on a terminal only, never in a log file)
            for path in self.files:
                if os.path.getsize(path) == 0:
                    raise BadInputError(f"{path}: the file is empty (expected data={self.data.name} rows)")
                line = 1
                for chunk, _ in self._chunks(path, bar):
                    lines = self._lines(chunk)
                    self.position = (path, line)
                    line += len(lines)
                    yield self._block(lines)


def _offsets(rows: np.ndarray, n: int) -> pa.Array:
    """List offsets of ``n`` rows from the (sorted) row of each value."""
    return pa.array(np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).astype(np.int32))


def open_reader(files, data, block_size: int, policy: str, desc: str) -> RawReader:
    """The reader of ``data.format``."""
    cls = {"parquet": ParquetReader, "libsvm": LibsvmReader}.get(data.format, RawReader)
    return cls(files, data, block_size, policy, desc)
