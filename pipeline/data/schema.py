"""Column layouts of the supported raw formats.

A schema names the label, the integer ("dense") columns and the categorical features; what is read
from the file (``read_columns``), which read columns must hold integers (``int_columns``), and an
optional ``derive`` step that turns the read columns into the categorical features (Avazu's
``hour`` → hour of day and weekday).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Schema:
    name: str
    label: str
    dense: tuple[str, ...]
    categorical: tuple[str, ...]
    columns: tuple[str, ...]          # file columns in order (the header, where there is one)
    delimiter: str
    header: bool
    read_columns: tuple[str, ...] = ()  # default: label + dense + categorical
    int_columns: tuple[str, ...] = ()   # read columns that must hold integers (label and dense always)
    quote_char: str | bool = False
    derive: Callable[[pa.Table], pa.Table] | None = None

    def __post_init__(self) -> None:
        if not self.read_columns:
            object.__setattr__(self, "read_columns", (self.label, *self.dense, *self.categorical))
        object.__setattr__(self, "int_columns", tuple(dict.fromkeys((self.label, *self.dense, *self.int_columns))))

    def arrow_schema(self) -> pa.Schema:
        """Types of the file's columns as written by the synthetic generator (Criteo layout)."""
        types = {self.label: pa.int8(), **{c: pa.int64() for c in self.dense},
                 **{c: pa.string() for c in self.categorical}}
        return pa.schema([(c, types[c]) for c in self.columns if c in types])


_I = tuple(f"I{i}" for i in range(1, 14))
_C = tuple(f"C{i}" for i in range(1, 27))

CRITEO = Schema(name="criteo", label="label", dense=_I, categorical=_C,
                columns=("label", *_I, *_C), delimiter="\t", header=False)


def _avazu_time(table: pa.Table) -> pa.Table:
    """``hour`` (YYMMDDHH) → categorical ``hour_of_day`` (00–23) and ``weekday`` (0 = Monday)."""
    h = table.column("hour").to_numpy()
    day = _dates(h)
    weekday = ((day.astype(np.int64) + 3) % 7).astype(str)  # 1970-01-01 was a Thursday (3)
    hour = np.char.zfill((h % 100).astype(str), 2)
    table = table.drop_columns(["hour"])
    return table.append_column("hour_of_day", pa.array(hour)).append_column("weekday", pa.array(weekday))


def _dates(h: np.ndarray) -> np.ndarray:
    """Vectorised YYMMDD of YYMMDDHH → datetime64[D] (unique dates are few)."""
    ymd, inverse = np.unique(h // 100, return_inverse=True)
    days = np.array([f"20{v // 10000:02d}-{v // 100 % 100:02d}-{v % 100:02d}" for v in ymd], dtype="datetime64[D]")
    return days[inverse]


_AVAZU_COLUMNS = ("id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
                  "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
                  "device_conn_type", *(f"C{i}" for i in range(14, 22)))
_AVAZU_CATEGORICAL = tuple(c for c in _AVAZU_COLUMNS if c not in ("id", "click", "hour")) + ("hour_of_day", "weekday")

AVAZU = Schema(name="avazu", label="click", dense=(), categorical=_AVAZU_CATEGORICAL, columns=_AVAZU_COLUMNS,
               delimiter=",", header=True, quote_char='"',
               read_columns=tuple(c for c in _AVAZU_COLUMNS if c != "id"), int_columns=("hour",),
               derive=_avazu_time)

_FRAPPE_CATEGORICAL = ("user", "item", "daytime", "weekday", "isweekend", "homework", "cost", "weather", "country",
                       "city")
FRAPPE = Schema(name="frappe", label="label", dense=(), categorical=_FRAPPE_CATEGORICAL,
                columns=("label", *_FRAPPE_CATEGORICAL), delimiter=",", header=True, quote_char='"')

SCHEMAS: dict[str, Schema] = {s.name: s for s in (CRITEO, AVAZU, FRAPPE)}
