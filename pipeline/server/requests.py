"""Request bodies of MLflow's scoring protocol → raw columns (or encoded rows), without pandas; and of ``/rank``.

    application/json   {"dataframe_split": {"columns": [c, ...], "data": [[v, ...], ...]}}   ("index" ignored)
                       {"dataframe_records": [{c: v, ...}, ...]}
                       {"instances": [{c: v, ...}, ...]}  or  {"instances": {c: [v, ...], ...}};  "inputs" alike
    text/csv           CSV with a header row naming the columns (MLflow's CSV input)
    text/x-ctr-rows    lines exactly as the dataset's training files hold them (its delimiter and columns,
                       with or without the label): the dataset's own reader, checks and messages

    POST /rank         application/json: {"context": {column: value, ...}, "candidates": {column: [value, ...], ...}}
                       application/vnd.apache.arrow.stream (an Arrow IPC stream): the candidates' columns as its record
                       batches, one row per candidate; the context as the schema's metadata key ``context``, a JSON
                       object {column: value} (:func:`parse_rank`; scored by :mod:`pipeline.scoring.ranking`)

Values are raw, as in the training files: strings in categorical columns, numbers or strings of
numbers in numeric ones, null / NaN / "" for a missing value. The JSON forms become a mapping
column → list of values (:class:`Parsed`); what the model reads of it is checked when the batch is
encoded (:meth:`pipeline.scoring.row_encoder.RowEncoder.encode_columns`), so a missing column or a
word in a numeric column gets a 400 naming it there. Anything malformed here raises
:class:`RequestError` (HTTP 400) naming the field.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.csv as pacsv

from pipeline.data.features import extract
from pipeline.data.other_readers import open_reader
from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import UserError
from pipeline.scoring.prediction import has_label
from pipeline.scoring.row_encoder import Columns, RowEncoder

JSON_FORMATS = ("dataframe_split", "dataframe_records", "instances", "inputs")
RAW_ROWS = "text/x-ctr-rows"


class RequestError(ValueError):
    """A request the server cannot read: HTTP 400 with this message."""


@dataclass
class Parsed:
    """One request: its raw columns (JSON, CSV) or its raw lines (``text/x-ctr-rows``), and its row count."""

    rows: int
    columns: Columns | None = None
    lines: bytes | None = None


def parse(body: bytes, content_type: str) -> Parsed:
    """The request body of ``POST /invocations`` by its content type."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("", "application/json"):
        return _json(body)
    if kind == "text/csv":
        return _csv(body)
    if kind == RAW_ROWS:
        rows = body.count(b"\n") + (not body.endswith(b"\n") and len(body) > 0)
        return Parsed(rows, lines=body)
    raise RequestError(f"Content-Type {content_type!r}: expected application/json, text/csv or {RAW_ROWS}")


def _load_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise RequestError(f"request body: not JSON ({e})") from None


def _json(body: bytes) -> Parsed:
    doc = _load_json(body)
    keys = [k for k in JSON_FORMATS if isinstance(doc, dict) and k in doc]
    if len(keys) != 1:
        raise RequestError(f"request body: expected a JSON object with exactly one of {', '.join(JSON_FORMATS)}"
                           + (f"; it has {sorted(doc)[:10]}" if isinstance(doc, dict) else ""))
    key, value = keys[0], doc[keys[0]]
    if key == "dataframe_split":
        return _split(value)
    if isinstance(value, dict):  # instances / inputs as columns
        return _by_column(key, value)
    return _records(key, value)


def _split(value: Any) -> Parsed:
    if not isinstance(value, dict) or not isinstance(value.get("columns"), list) or not isinstance(value.get("data"), list):
        raise RequestError("dataframe_split: expected {\"columns\": [names], \"data\": [[values], ...]}")
    names, data = [str(c) for c in value["columns"]], value["data"]
    for i, row in enumerate(data):
        if not isinstance(row, list) or len(row) != len(names):
            raise RequestError(f"dataframe_split.data[{i}]: expected a list of {len(names)} values (one per column), "
                               f"got {_short(row)}")
    columns = dict(zip(names, zip(*data))) if data else {c: () for c in names}
    return Parsed(len(data), columns)


def _records(key: str, value: Any) -> Parsed:
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        bad = next((i for i, r in enumerate(value) if not isinstance(r, dict)), None) if isinstance(value, list) else None
        where = f"{key}[{bad}]" if bad is not None else key
        raise RequestError(f"{where}: expected a list of objects {{column: value}}")
    names = list(dict.fromkeys(c for r in value for c in r))  # a column absent from a record: missing there
    return Parsed(len(value), {c: [r.get(c) for r in value] for c in names})


def _by_column(key: str, value: dict) -> Parsed:
    lengths = {c: len(v) if isinstance(v, list) else None for c, v in value.items()}
    bad = [c for c, n in lengths.items() if n is None]
    if bad:
        raise RequestError(f"{key}.{bad[0]}: expected a list of values (one per row)")
    if len(set(lengths.values())) > 1:
        raise RequestError(f"{key}: columns of different lengths {dict(list(lengths.items())[:10])}")
    return Parsed(next(iter(lengths.values()), 0), dict(value))


def _csv(body: bytes) -> Parsed:
    """Every column read as text (as a training file is: "0123" stays "0123"); empty cells are missing."""
    # the header as Arrow reads it: empty lines skipped, any of the three line ends ends a line
    first_line = re.split(rb"\r\n|\r|\n", body.lstrip(b"\r\n"), maxsplit=1)[0]
    try:
        header = next(csv.reader([first_line.decode("utf-8")]), [])  # Arrow does not check its header is UTF-8
        table = pacsv.read_csv(pa.BufferReader(body), convert_options=pacsv.ConvertOptions(
            column_types={name: pa.string() for name in header}, strings_can_be_null=True))
    except (pa.ArrowInvalid, ValueError, csv.Error) as e:
        raise RequestError(f"text/csv body: {e}") from None
    return Parsed(table.num_rows, {name: table.column(name).to_pylist() for name in table.column_names})


ARROW_STREAM = "application/vnd.apache.arrow.stream"
CONTEXT_KEY = b"context"  # the Arrow schema's metadata key holding the context


@dataclass
class RankRequest:
    context: dict[str, Any]        # column → its one value
    candidates: Mapping[str, Any]  # column → its values (a list, or an Arrow column), one per candidate
    rows: int


def parse_rank(body: bytes, content_type: str) -> RankRequest:
    """A ``POST /rank`` body by its content type (module docstring)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("", "application/json"):
        return _rank_json(body)
    if kind == ARROW_STREAM:
        return _rank_arrow(body)
    raise RequestError(f"Content-Type {content_type!r}: /rank takes application/json or {ARROW_STREAM}")


def _rank_json(body: bytes) -> RankRequest:
    doc = _load_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("context"), dict) or \
            not isinstance(doc.get("candidates"), dict):
        raise RequestError('request body: expected {"context": {column: value, ...}, '
                           '"candidates": {column: [values], ...}}')
    candidates = _by_column("candidates", doc["candidates"])  # lists of one length, one value per candidate
    return RankRequest(_context(doc["context"]), candidates.columns, candidates.rows)


def _context(context: dict[str, Any]) -> dict[str, Any]:
    for column, value in context.items():
        if isinstance(value, (list, dict)):
            raise RequestError(f"context.{column}: expected one value shared by every candidate, got "
                               f"{'a list' if isinstance(value, list) else 'an object'}; a column whose value differs "
                               f"per candidate goes in candidates")
    return context


def _rank_arrow(body: bytes) -> RankRequest:
    try:
        table = pa.ipc.open_stream(pa.BufferReader(body)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise RequestError(f"{ARROW_STREAM} body: {e}") from None
    meta = table.schema.metadata or {}
    if CONTEXT_KEY not in meta:
        raise RequestError(f"{ARROW_STREAM} body: the schema's metadata has no 'context' key (a JSON object "
                           f"{{column: value}} shared by every candidate)")
    try:
        context = json.loads(meta[CONTEXT_KEY])
    except ValueError as e:
        raise RequestError(f"{ARROW_STREAM} body: metadata 'context': not JSON ({e})") from None
    if not isinstance(context, dict):
        raise RequestError(f"{ARROW_STREAM} body: metadata 'context': expected a JSON object {{column: value}}")
    return RankRequest(_context(context), {name: table.column(name) for name in table.column_names}, table.num_rows)


def encode_lines(encoder: RowEncoder, body: bytes) -> SplitArrays:
    """Raw lines of the dataset's own layout, read by its reader (errors name the line and column)."""
    fd, name = tempfile.mkstemp(prefix="ctr-serve-", suffix=".rows")
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
        try:
            data = encoder.reading(has_label(encoder.data, path))
            reader = open_reader([path], data, 32 << 20, "error", "request")
            blocks = [encoder.encode(extract(table, data, reader.where, {})) for table in reader]
        except (UserError, ValueError) as e:
            raise RequestError(str(e).replace(str(path), "request body")) from None
    finally:
        path.unlink(missing_ok=True)
    if not blocks:
        raise RequestError(f"{RAW_ROWS} body: no rows")
    return SplitArrays.concat(blocks)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
