"""Fuzzing the readers (Hypothesis): the real sample files of ../shared/data, mutated — truncated lines,
extra or missing delimiters, non-UTF-8 bytes, huge numbers, NaN/inf text, quotes and embedded
newlines, BOMs, CRLF line ends, empty fields and lines, a file cut anywhere. Preprocessing must either
succeed with every line as a row, or raise ``BadInputError`` naming the file (and line) — never another
exception, never a half-written store. ``CTR_FUZZ_EXAMPLES`` sets the cases per layout (default 60).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.data.dataset import builtin_layout
from pipeline.data.preprocess import preprocess
from pipeline.data.preprocess_config import PreprocessConfig, SplitConfig
from pipeline.runtime.errors import BadInputError
from tests.conftest import shared_file

SAMPLES = {"criteo": ("criteo_sample/dac_sample.tsv", builtin_layout("criteo")),
           "avazu": ("avazu_sample/avazu_sample.csv", builtin_layout("avazu")),
           "frappe": ("frappe_x1/valid.csv", builtin_layout("frappe"))}
ROWS = 30
EXAMPLES = int(os.environ.get("CTR_FUZZ_EXAMPLES", 60))
VALUES = [b"\xff\xfe", b"\xc3", "é".encode(), b"9" * 25, b"-9" * 12, b"NaN", b"inf", b"-inf", b"1e400", b'"q"',
          b'"a,b"', b'"x\ny"', b"", b" ", b"\t", b"\r", b"0", b"2", b"-1", b"\x00"]


def _head(relative: str, schema) -> bytes:
    with open(shared_file(relative), "rb") as fh:
        return b"".join(fh.readline() for _ in range(ROWS + int(schema.header)))


@st.composite
def mutated(draw: st.DrawFn, original: bytes, delimiter: bytes) -> bytes:
    lines = original.split(b"\n")[:-1]
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["truncate", "extra_delim", "drop_delim", "value", "empty_line", "crlf", "bom",
                                     "cut_file"]))
        fields = lines[i].split(delimiter)
        if kind == "truncate":
            lines[i] = lines[i][:draw(st.integers(0, max(0, len(lines[i]) - 1)))]
        elif kind == "extra_delim":
            fields.insert(draw(st.integers(0, len(fields))), b"")
            lines[i] = delimiter.join(fields)
        elif kind == "drop_delim" and len(fields) > 1:
            j = draw(st.integers(0, len(fields) - 2))
            lines[i] = delimiter.join(fields[:j] + [fields[j] + fields[j + 1]] + fields[j + 2:])
        elif kind == "value":
            fields[draw(st.integers(0, len(fields) - 1))] = draw(st.sampled_from(VALUES))
            lines[i] = delimiter.join(fields)
        elif kind == "empty_line":
            lines.insert(i, b"")
        elif kind == "crlf":
            lines = [line + b"\r" for line in lines]
        elif kind == "bom":
            lines[0] = b"\xef\xbb\xbf" + lines[0]
    data = b"\n".join(lines) + (b"\n" if draw(st.booleans()) else b"")
    if draw(st.integers(0, 9)) == 0:  # a file cut anywhere, even to nothing
        data = data[:draw(st.integers(0, len(data)))]
    return data


def _lines(data: bytes, header: bool) -> int:
    n = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    return n - int(header)


@pytest.mark.parametrize("layout", sorted(SAMPLES))
def test_mutated_files_preprocess_or_fail_with_file_and_line(layout, tmp_path_factory):
    relative, schema = SAMPLES[layout]
    original = _head(relative, schema)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=mutated(original, schema.delimiter.encode()))
    def check(data: bytes) -> None:
        folder = tmp_path_factory.mktemp(layout)
        path, out = folder / f"in.{'tsv' if schema.delimiter == chr(9) else 'csv'}", folder / "store"
        path.write_bytes(data)
        cfg = PreprocessConfig(min_count=1, split=SplitConfig(valid=0.2, test=0.2))
        try:
            store = preprocess([path], builtin_layout(layout, cfg), out)
        except BadInputError as e:
            assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", str(e)), str(e)
            assert sorted(p.name for p in folder.iterdir()) == [path.name]  # no store, nothing half-written
        else:
            assert sum(store.meta["splits"].values()) == _lines(data, schema.header), data[:300]
            assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, out.name])
        shutil.rmtree(folder)

    check()
