"""Vocabulary files: the one reader and writer of ``<folder>/vocab/<table>.parquet``, in a store and
in a model folder alike.

Columns: ``key`` (uint64; the value's key, 0 at a free position), ``count`` (int64; training count),
``last_seen`` and ``since`` (int32; days, :mod:`pipeline.data.vocab_growth`). Position p holds the value
of id ``FIRST_VOCAB_ID + p``. Files written before ``last_seen`` and ``since`` existed read them as 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.vocab_growth import TableVocabulary

COLUMNS = {"key": np.uint64, "count": np.int64, "last_seen": np.int32, "since": np.int32}


def vocabulary_file(folder: str | os.PathLike, table: str) -> Path:
    """Where table ``table``'s vocabulary lives in a store or model ``folder``."""
    return Path(folder) / "vocab" / f"{table}.parquet"


def write_vocabulary(vocab_dir: Path, table: str, vocab: TableVocabulary) -> None:
    pq.write_table(pa.table({"key": pa.array(vocab.keys, pa.uint64()), "count": vocab.counts,
                             "last_seen": vocab.last_seen, "since": vocab.since}), vocab_dir / f"{table}.parquet")


def read_vocabulary(folder: str | os.PathLike, table: str, columns: tuple[str, ...] = tuple(COLUMNS),
                    rows: int | None = None) -> TableVocabulary | None:
    """Table ``table``'s vocabulary in ``folder`` (None: the folder has none for it, e.g. a hashed table);
    only ``columns`` are read, the others are empty. Raises ``ValueError`` naming the file when it cannot
    be read, or when ``rows`` is given and the file holds another number of values."""
    path = vocabulary_file(folder, table)
    if not path.is_file():
        return None
    try:
        t = pq.read_table(path, columns=[c for c in columns if c in pq.read_schema(path).names])
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: cannot read the vocabulary of table {table!r} ({e})") from None
    if rows is not None and t.num_rows != rows:
        raise ValueError(f"{path}: {t.num_rows} values, expected {rows} (table {table!r}): a damaged vocabulary file")
    n = t.num_rows

    def column(name: str) -> np.ndarray:
        if name not in columns:
            return np.zeros(0, COLUMNS[name])
        return t.column(name).to_numpy().astype(COLUMNS[name]) if name in t.column_names else np.zeros(n, COLUMNS[name])

    return TableVocabulary(*(column(name) for name in COLUMNS))
