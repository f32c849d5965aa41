"""Column layouts of the supported raw formats."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class Schema:
    """A raw CTR file layout: one label, integer (dense) columns and categorical columns."""

    name: str
    label: str
    dense: tuple[str, ...]
    categorical: tuple[str, ...]
    columns: tuple[str, ...]  # in file order
    delimiter: str
    header: bool

    def arrow_schema(self) -> pa.Schema:
        types = {self.label: pa.int8(), **{c: pa.int64() for c in self.dense},
                 **{c: pa.string() for c in self.categorical}}
        return pa.schema([(c, types[c]) for c in self.columns if c in types])


_I = tuple(f"I{i}" for i in range(1, 14))
_C = tuple(f"C{i}" for i in range(1, 27))

CRITEO = Schema(name="criteo", label="label", dense=_I, categorical=_C,
                columns=("label", *_I, *_C), delimiter="\t", header=False)
