"""Named derivations of a categorical feature from a time column (``derive:`` in a dataset declaration).

The column is parsed with ``time_format`` — ``iso`` (``2017-11-07 09:30:38``, ``2017-11-07T09:30``),
``unix`` (seconds since 1970-01-01 UTC) or a strptime pattern (Avazu's ``%y%m%d%H``) — and becomes:

* ``hour_of_day``: ``"00"`` … ``"23"``
* ``weekday``: ``"0"`` (Monday) … ``"6"``
* ``date``: ``"YYYY-MM-DD"``

as UTF-8 strings, so the derived values are keyed like any other categorical value. A missing time
stays missing; a value that is not a time in that format is a bad value (:class:`BadValue`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class BadValue(ValueError):
    """A value a derivation cannot read: ``index`` is its row in the block."""

    def __init__(self, index: int, value: str, expected: str) -> None:
        super().__init__(f"{value!r}; expected {expected}")
        self.index, self.value, self.expected = index, value, expected


def _first_failure(text: pa.Array, parsed: pa.Array) -> int:
    bad = np.asarray(pc.and_(pc.is_null(parsed), pc.is_valid(text)).to_numpy(zero_copy_only=False))
    return int(np.argmax(bad)) if bad.any() else -1


def parse_times(text: pa.Array, time_format: str) -> pa.Array:
    """String column → timestamp[s] (UTC); raises :class:`BadValue` at the first unreadable value."""
    text = pc.cast(text, pa.string())
    if time_format == "unix":
        ok = pc.fill_null(pc.match_substring_regex(text, r"^[+-]?[0-9]+$"), True)
        parsed = pc.cast(pc.if_else(ok, text, pa.scalar(None, pa.string())), pa.int64())
        expected = "a time in seconds since 1970 (time_format: unix)"
        parsed = pc.cast(parsed, pa.timestamp("s"))
    elif time_format == "iso":
        parsed = pc.strptime(pc.replace_substring(text, "T", " "), format="%Y-%m-%d %H:%M:%S", unit="s",
                             error_is_null=True)
        short = pc.strptime(text, format="%Y-%m-%d", unit="s", error_is_null=True)
        minutes = pc.strptime(pc.replace_substring(text, "T", " "), format="%Y-%m-%d %H:%M", unit="s",
                              error_is_null=True)
        parsed = pc.coalesce(parsed, minutes, short)
        expected = "a time like 2017-11-07 09:30:38 (time_format: iso)"
    else:
        parsed = pc.strptime(text, format=time_format, unit="s", error_is_null=True)
        expected = f"a time in the format {time_format!r}"
    i = _first_failure(text, parsed)
    if i >= 0:
        raise BadValue(i, text[i].as_py(), expected)
    return parsed


def derive(text: pa.Array, derivation: str, time_format: str) -> pa.Array:
    """The derived categorical values (strings) of a time column (module docstring)."""
    t = parse_times(text, time_format)
    if derivation == "hour_of_day":
        return pc.utf8_lpad(pc.cast(pc.hour(t), pa.string()), 2, "0")
    if derivation == "weekday":
        return pc.cast(pc.day_of_week(t), pa.string())  # ISO: Monday = 0
    if derivation == "date":
        return pc.strftime(t, format="%Y-%m-%d")
    raise ValueError(f"derive={derivation!r}: unknown derivation")
