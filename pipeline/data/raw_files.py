"""Opening a raw data file: gzip or plain, and its first line's fields (a header, where it has one)."""

from __future__ import annotations

from pathlib import Path


def open_lines(path: Path):
    """Binary file object of a raw file, decompressing ``.gz``."""
    if str(path).endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def first_fields(path: Path, delimiter: str) -> list[str]:
    """The fields of a delimited file's first line (its header, where it has one), quotes stripped."""
    with open_lines(path) as fh:
        first = fh.readline().rstrip(b"\r\n").decode("utf-8", "backslashreplace")
    return [f.strip('"') for f in first.split(delimiter)]
