"""A vocabulary that continues an earlier one: ids kept, new values added, stale values evicted.

Given the base vocabulary of a table (key at position p has id p + 2; key 0 marks a free position)
with each key's ``last_seen`` day, and this day's training keys and counts:

* every base key seen today keeps its position, ``last_seen = day``; one not seen keeps its position
  while ``day − last_seen < evict_after`` (always, without eviction), else it is evicted: its position
  becomes free and its id OOV;
* today's keys new to the base with count >= ``min_count``, most frequent first (ties by key), take the
  free positions first (lowest first), then positions after the end; ``since = day`` marks where a
  key took a position this day (a reused position's row must start afresh: :mod:`pipeline.training.init_from`).

So a table grows only by the values that are new while others are still live: over a stream whose id
set drifts, its size stays bounded by the values live within ``evict_after`` days.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

FREE = np.uint64(0)  # no real key is 0 (hashing maps a 0 key to 1; 0 means "missing")


@dataclass
class TableVocabulary:
    keys: np.ndarray       # uint64 [n], FREE at free positions
    counts: np.ndarray     # int64 [n], today's training counts
    last_seen: np.ndarray  # int32 [n]
    since: np.ndarray      # int32 [n], the day the key took its position


def fresh(keys: np.ndarray, counts: np.ndarray, day: int) -> TableVocabulary:
    n = len(keys)
    return TableVocabulary(keys, counts, np.full(n, day, np.int32), np.full(n, day, np.int32))


def grow(base: TableVocabulary, keys: np.ndarray, counts: np.ndarray, min_count: int, day: int,
         evict_after: int | None) -> TableVocabulary:
    """The next day's vocabulary (module docstring); ``keys``/``counts``: today's distinct training keys."""
    today = pd.Series(counts, index=pd.Index(keys, dtype=np.uint64))
    seen = today.reindex(pd.Index(base.keys, dtype=np.uint64)).fillna(0).to_numpy(np.int64, copy=True)
    seen[base.keys == FREE] = 0
    last_seen = np.where(seen > 0, day, base.last_seen).astype(np.int32)
    live = base.keys != FREE
    if evict_after is not None:
        live &= day - last_seen < evict_after
    out_keys = np.where(live, base.keys, FREE)
    new = (counts >= min_count) & ~np.isin(keys, base.keys[live])
    order = np.lexsort((keys[new], -counts[new]))
    new_keys, new_counts = keys[new][order], counts[new][order]
    holes = np.flatnonzero(~live)[:len(new_keys)]
    extra = len(new_keys) - len(holes)
    out_keys = np.concatenate([out_keys, np.zeros(extra, np.uint64)])
    out_counts = np.concatenate([np.where(live, seen, 0), np.zeros(extra, np.int64)])
    out_last = np.concatenate([np.where(live, last_seen, 0), np.zeros(extra, np.int32)]).astype(np.int32)
    out_since = np.concatenate([base.since, np.zeros(extra, np.int32)]).astype(np.int32)
    where = np.concatenate([holes, len(base.keys) + np.arange(extra)]).astype(np.int64)
    out_keys[where], out_counts[where], out_last[where], out_since[where] = new_keys, new_counts, day, day
    return TableVocabulary(out_keys, out_counts, out_last, out_since)


class VocabIndex:
    """Key → id lookups over a vocabulary with free positions (a pandas Index keeps its hash table)."""

    def __init__(self, keys: np.ndarray) -> None:
        self.positions = np.flatnonzero(keys != FREE)
        self.index = pd.Index(keys[self.positions], dtype=np.uint64)

    def positions_of(self, keys: np.ndarray) -> np.ndarray:
        """Position of each key in the vocabulary, -1 where absent."""
        found = self.index.get_indexer(keys)
        if not len(self.positions):  # an empty vocabulary (e.g. a column without a kept value)
            return np.full(len(keys), -1, dtype=np.int64)
        return np.where(found >= 0, self.positions[np.maximum(found, 0)], -1)
