"""``model.zch``: the typed config of zero-collision tables (:mod:`modules.embedding.zch.remapper` uses it) and the
rows every table reserves: row 1 for missing values, rows 2 … N + 1 for ids (the last: ids not admitted)."""

from __future__ import annotations

from dataclasses import dataclass, field

MISSING_ROW = 1
FIRST_ROW = 2
EVICTIONS = ("lru", "lfu", "distance_lfu", "ttl")
CLOCKS = ("day", "time")


@dataclass
class ZchConfig:
    """``model.zch``: tables of ``rows`` rows (``tables``: per-table overrides) whose rows ids take by
    admission (:mod:`modules.embedding.zch.remapper`). ``rows`` 0: off (the store's vocabulary or hashing sizes
    the tables)."""

    rows: int = 0
    tables: dict[str, int] = field(default_factory=dict)
    eviction: str = "lru"           # lru | lfu | distance_lfu | ttl
    eviction_interval: int = 16     # training steps between admission rounds
    ttl_days: float = 7             # eviction=ttl: days an id keeps its row unseen
    ttl_clock: str = "day"          # eviction=ttl: day (the store's day index) | time (rows' times, data.time)
    min_count: int = 1              # occurrences before a new id may take a row (modules/embedding/zch/admission.py)
    probation: float = 4.0          # min_count > 1: new ids counted on probation, × the rows of all tables
    buckets: int = 1                # mappings per table, each an LRU/TTL over rows / buckets (modules/embedding/zch/exchange.py)

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"model.zch.eviction={self.eviction!r}: expected one of {EVICTIONS}")
        if self.eviction_interval < 1:
            raise ValueError(f"model.zch.eviction_interval={self.eviction_interval}: expected a number of steps >= 1")
        if self.min_count < 1:
            raise ValueError(f"model.zch.min_count={self.min_count}: expected a number of occurrences >= 1")
        if self.probation <= 0:
            raise ValueError(f"model.zch.probation={self.probation}: expected a positive multiple of the tables' rows")
        if self.ttl_clock not in CLOCKS:
            raise ValueError(f"model.zch.ttl_clock={self.ttl_clock!r}: expected one of {CLOCKS}")
        if self.ttl_clock == "time" and self.eviction != "ttl":
            raise ValueError(f"model.zch.ttl_clock=time: only eviction=ttl reads a clock (eviction={self.eviction})")
        if self.ttl_days <= 0 or (self.ttl_clock == "day" and self.ttl_days < 1):
            raise ValueError(f"model.zch.ttl_days={self.ttl_days}: expected a number of days "
                             f"{'>= 1 (ttl_clock=day counts whole days)' if self.ttl_clock == 'day' else '> 0'}")
        if self.buckets < 1:
            raise ValueError(f"model.zch.buckets={self.buckets}: expected a number of buckets >= 1")
        for name, n in {"rows": self.rows, **{f"tables.{k}": v for k, v in self.tables.items()}}.items():
            if n < 0 or (n and n < 2):
                raise ValueError(f"model.zch.{name}={n}: expected 0 (off) or at least 2 rows")
            if n and (n % self.buckets or n // self.buckets < 2):
                raise ValueError(f"model.zch.{name}={n}: expected a multiple of model.zch.buckets={self.buckets} "
                                 f"with at least 2 rows a bucket (each bucket holds an equal share of the rows)")
        if self.tables and not self.rows:
            raise ValueError("model.zch.tables: per-table rows need model.zch.rows as the default")

    @property
    def enabled(self) -> bool:
        return self.rows > 0

    def table_sizes(self, tables: list[str]) -> dict[str, int]:
        """Rows of each table's embedding table: its ``rows`` and the missing and unused rows."""
        unknown = sorted(set(self.tables) - set(tables))
        if unknown:
            raise ValueError(f"model.zch.tables.{unknown[0]}: no such table (tables: {', '.join(tables)})")
        return {t: self.tables.get(t, self.rows) + FIRST_ROW for t in tables}
