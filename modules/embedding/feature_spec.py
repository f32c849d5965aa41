"""What a model needs to know about the data: its dense and sparse features, the tables they read and the
tables' sizes (:class:`FeatureSpec`, from a store's meta or a dataset declaration)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class FeatureSpec:
    """What a model needs to know about the data: features, the tables they read, table sizes."""

    dense: tuple[str, ...]
    categorical: tuple[str, ...]                 # one id per row
    table_sizes: dict[str, int]                  # rows of each table (vocabulary + OOV + missing)
    sequence: tuple[str, ...] = ()               # a bag of ids per row
    pooling: dict[str, str] = field(default_factory=dict)  # sequence feature → "sum" | "mean"
    tables: dict[str, str] = field(default_factory=dict)   # feature → the table it reads (default: its own)

    @classmethod
    def from_store_meta(cls, meta: dict) -> "FeatureSpec":
        features = meta.get("features", [])
        return cls(tuple(meta["dense"]), tuple(meta["categorical"]),
                   {k: int(v) for k, v in meta["table_sizes"].items()}, tuple(meta.get("sequence", ())),
                   {f["name"]: f["pooling"] for f in features if "pooling" in f},
                   {f["name"]: f["table"] for f in features if f["table"] != f["name"]})

    @classmethod
    def of_data(cls, data: Any, table_sizes: dict[str, int]) -> "FeatureSpec":
        """The spec of a dataset declaration (:class:`pipeline.data.dataset.DataConfig`) with these table sizes."""
        sparse = (*data.categorical, *data.sequence)
        return cls(tuple(data.numeric), tuple(data.categorical), dict(table_sizes), tuple(data.sequence),
                   {f: data.decl(f).pooling for f in data.sequence},
                   {f: data.table_of(f) for f in sparse if data.table_of(f) != f})

    @cached_property  # the spec is frozen: computed once
    def sparse(self) -> tuple[str, ...]:
        return self.categorical + self.sequence

    def table_of(self, feature: str) -> str:
        return self.tables.get(feature, feature)

    @cached_property
    def unpooled_tables(self) -> tuple[str, ...]:
        """Tables read by a sequence feature or by several features: they live in the EmbeddingCollection,
        where every occurrence of an id has its own row (exact per-id statistics for CowClip)."""
        readers: dict[str, int] = {}
        for f in self.sparse:
            readers[self.table_of(f)] = readers.get(self.table_of(f), 0) + 1
        return tuple(dict.fromkeys(t for f in self.sparse if (t := self.table_of(f)) in
                                   {self.table_of(g) for g in self.sequence} or readers[t] > 1))

    @cached_property
    def bag_features(self) -> tuple[str, ...]:
        return tuple(f for f in self.sparse if self.table_of(f) not in self.unpooled_tables)

    @cached_property
    def seq_features(self) -> tuple[str, ...]:
        return tuple(f for f in self.sparse if self.table_of(f) in self.unpooled_tables)

    @cached_property
    def kjt_keys(self) -> tuple[str, ...]:
        """The batch's KJT keys, in order: the bag collection's features, then the sequence collection's."""
        return self.bag_features + self.seq_features
