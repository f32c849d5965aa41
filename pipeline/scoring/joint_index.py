"""One hash index over the vocabularies of every table, so that a request's ids of all features are
looked up in one pass instead of one per table.

Entry (table t, key k) is indexed under s = splitmix64(k ⊕ c_t), c_t = splitmix64(hash_keys(t)) computed once
per table (s is :func:`pipeline.data.hashing.hash_keys` of (t, k)); for a fixed t this is a bijection of k, so a
hit whose entry belongs to table t is exactly key k of table t (the entry's table is checked). Position p of a
table's vocabulary is id ``FIRST_VOCAB_ID + p``, as in :class:`pipeline.data.vocab_growth.VocabIndex`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.data.hashing import hash_keys, splitmix64
from pipeline.data.vocab_growth import FREE


class JointVocabIndex:
    def __init__(self, vocabularies: dict[str, np.ndarray]) -> None:
        """``vocabularies``: table → its keys in position order (``FREE`` at free positions)."""
        self.tables = {name: t for t, name in enumerate(vocabularies)}
        self.salts = splitmix64(hash_keys(np.arange(len(self.tables), dtype=np.uint64)))
        salted, tables, positions = [], [], []
        for name, keys in vocabularies.items():
            live = np.flatnonzero(keys != FREE)
            salted.append(self._salted(keys[live], self.tables[name]))
            tables.append(np.full(len(live), self.tables[name], np.int16))
            positions.append(live)
        self.index = pd.Index(np.concatenate(salted) if salted else np.zeros(0, np.uint64), dtype=np.uint64)
        self.table_of = np.concatenate(tables) if tables else np.zeros(0, np.int16)
        self.positions = np.concatenate(positions) if positions else np.zeros(0, np.int64)

    def _salted(self, keys: np.ndarray, tables: np.ndarray | int) -> np.ndarray:
        """The index's key of each (table, key): ``hash_keys(t, k)``, its table part taken from the salts."""
        return splitmix64(keys ^ self.salts[tables])

    def positions_of(self, keys: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """Position of each ``keys[i]`` in the vocabulary of table number ``tables[i]``, -1 where absent."""
        found = self.index.get_indexer(self._salted(keys, tables))
        if not len(self.positions):
            return np.full(len(keys), -1, np.int64)
        hit = (found >= 0) & (self.table_of[np.maximum(found, 0)] == tables)
        return np.where(hit, self.positions[np.maximum(found, 0)], -1)

    def table(self, name: str) -> "TableView":
        return TableView(self, self.tables[name])


class TableView:
    """One table's lookups through the joint index (what :func:`pipeline.data.encoding.encode_ids` takes)."""

    def __init__(self, joint: JointVocabIndex, table: int) -> None:
        self.joint, self.number = joint, table

    def positions_of(self, keys: np.ndarray) -> np.ndarray:
        return self.joint.positions_of(keys, np.full(len(keys), self.number, np.int16))
