"""The vocabulary of each embedding table, built from pass 1's training counts
(:mod:`pipeline.data.pass1`), and its statistics.

* ``vocab``: per embedding table (features with ``share_table_with`` count into one), values with
  training count >= ``min_count``, most frequent first (ties by key), get ids 2..; missing → 1;
  anything else (rare, or unseen in training) → 0 (OOV). With ``preprocess.base_vocabulary`` the
  vocabulary continues an earlier one (:mod:`pipeline.data.vocab_growth`).
* ``hash``: ``2 + key mod buckets`` (no vocabulary).
* ``raw``: nothing — no vocabulary, no table sizes, no statistics (``model.zch`` sizes the tables).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.dataset import DataConfig
from pipeline.data.pass1 import Pass1, Tables, merge_counts
from pipeline.data.store import FIRST_VOCAB_ID
from pipeline.data.vocab_files import read_vocabulary
from pipeline.data.vocab_growth import FREE, TableVocabulary, fresh, grow

COVERAGE_LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99)


def field_stats(counts: np.ndarray, kept: int) -> dict:
    """Cardinality, count histogram, top-1 % share and ``coverage_rows``: how many of the most
    frequent ids carry each share of the occurrences (what an embedding cache must hold)."""
    c = np.sort(counts)[::-1]
    total = int(c.sum())
    top = max(1, int(np.ceil(0.01 * len(c)))) if len(c) else 0
    cum = np.cumsum(c)
    coverage = {str(q): int(np.searchsorted(cum, q * total) + 1) if total else 0 for q in COVERAGE_LEVELS}
    edges = [1, 2, 5, 10, 100, 1000, 10_000, 100_000]
    hist = np.histogram(c, bins=edges + [np.inf])[0] if len(c) else np.zeros(len(edges), dtype=np.int64)
    return {
        "distinct_train": int(len(c)),
        "kept": int(kept),
        "occurrences_train": total,
        "kept_share": float(c[:kept].sum() / total) if total else 0.0,
        "top1pct_share": float(c[:top].sum() / total) if total else 0.0,
        "count_histogram": {"edges": edges, "ids": [int(h) for h in hist]},
        "coverage_rows": coverage,
    }


@dataclass
class Vocabulary:
    """Per embedding table: the keys in id order (vocab; :class:`TableVocabulary`), the table size and the
    statistics (occurrences: every value of every feature reading the table, sequences included)."""

    tables: dict[str, TableVocabulary]  # vocab only: key of id FIRST_VOCAB_ID + i at position i (FREE: none)
    table_sizes: dict[str, int]
    stats: dict[str, dict]
    day: int = 0                        # 0, or the base vocabulary's day + 1


def _folder_meta(folder: str | os.PathLike) -> dict:
    """The store meta of a store folder (meta.json) or a model folder (model.json)."""
    folder = Path(folder)
    if (folder / "meta.json").is_file():
        return json.loads((folder / "meta.json").read_text())
    if (folder / "model.json").is_file():
        return json.loads((folder / "model.json").read_text())["store"]
    raise ValueError(f"data.preprocess.base_vocabulary={folder}: not a store or model folder (no meta.json or "
                     f"model.json)")


def build_vocabulary(first: Pass1 | None, data: DataConfig) -> Vocabulary:
    """Keys with training count >= ``min_count``, most frequent first (ties by key); or hash buckets.

    With ``preprocess.base_vocabulary`` (an earlier store or model folder) the vocabulary continues the
    base's (:mod:`pipeline.data.vocab_growth`): its keys keep their ids, new keys with ``min_count``
    take free positions or are appended, and with ``preprocess.evict_after`` keys unseen for that many
    days free their positions."""
    cfg = data.preprocess
    day = int(_folder_meta(cfg.base).get("vocabulary_day", 0)) + 1 if cfg.base else 0
    vocab = Vocabulary({}, {}, {}, day)
    if cfg.categorical == "raw":
        return vocab
    for t, name in enumerate(Tables.of_data(data).names):
        if cfg.categorical == "hash":
            b = first.bucket_counts[t]
            vocab.stats[name] = field_stats(b[b > 0], int((b > 0).sum()))
            vocab.table_sizes[name] = cfg.hash_buckets + FIRST_VOCAB_ID
            continue
        parts = first.key_counts[t]
        k, n = merge_counts(parts) if parts else (np.zeros(0, np.uint64), np.zeros(0, np.int64))
        base = read_vocabulary(cfg.base, name) if cfg.base else None
        if base is None:
            keep = n >= cfg.min_count
            order = np.lexsort((k[keep], -n[keep]))
            table = fresh(k[keep][order], n[keep][order], day)
        else:
            table = grow(base, k, n, cfg.min_count, day, cfg.evict_after)
        vocab.tables[name] = table
        vocab.stats[name] = field_stats(n, int(np.count_nonzero(table.keys != FREE)))
        vocab.table_sizes[name] = len(table.keys) + FIRST_VOCAB_ID
    return vocab
