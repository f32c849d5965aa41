"""Admission by frequency for ``model.zch`` (``model.zch.min_count``): a new id takes a row only once it has
been seen ``min_count`` times, as a vocabulary keeps only values seen ``min_count`` times; until then it reads
the table's unknown row with the other rare ids.

The ids not holding a row are counted exactly on *probation*: a list of (id, occurrences, round last seen),
sorted by id, of at most ``capacity`` ids; past it the least recently seen leave and their counts are forgotten.
So a new id is admitted once seen ``min_count`` times among the last ``capacity`` or so new ids — a vocabulary's
count over a window of the stream instead of over a whole day it reads first. (2Q's A1 queue, Johnson & Shasha,
VLDB 1994, and TinyLFU's doorkeeper, Einziger et al., ACM ToS 2017, hold the same "seen recently" set, the
latter approximately; DeepRec's counter filter for EmbeddingVariable counts exactly per id.) Ids that take a row
leave probation (:meth:`ProbationAdmission.forget`); the held ids are never counted here.

Why not a count-min sketch (this file until 2026-11-26): 2 × 2^21 counters fed every occurrence of every id
saturated on the benchmark's logs (median counter 26 after 7 days of 22M distinct ids): every id was "seen twice"
at its first occurrence, so ``min_count`` admitted everything.

Memory: 20 bytes a probation id (``capacity`` is ``model.zch.probation`` × the rows of all tables); each round
costs a few linear passes over the list (merges of sorted arrays, no sort of the whole list).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAMES = ("ids", "counts", "last")


def merge_sorted(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of ``a``'s and ``b``'s elements in their merge (both sorted, no element in both): O(len)."""
    at_b = torch.searchsorted(a, b) + torch.arange(len(b), device="cpu")
    in_a = torch.ones(len(a) + len(b), dtype=torch.bool, device="cpu")
    in_a[at_b] = False
    return torch.nonzero(in_a).view(-1), at_b


class ProbationAdmission(nn.Module):
    """The probation list (module docstring): ``ids`` sorted, their ``counts`` and ``last`` round seen."""

    def __init__(self, min_count: int, capacity: int) -> None:
        super().__init__()
        self.min_count, self.capacity = min_count, max(1, capacity)
        self.register_buffer("ids", torch.zeros(0, dtype=torch.int64, device="cpu"))
        self.register_buffer("counts", torch.zeros(0, dtype=torch.int32, device="cpu"))
        self.register_buffer("last", torch.zeros(0, dtype=torch.int64, device="cpu"))

    @torch.no_grad()
    def admitted(self, ids: torch.Tensor, occurrences: torch.Tensor, round_: int) -> torch.Tensor:
        """Count ``occurrences`` of the (distinct, sorted) new ``ids`` in round ``round_``; whether each has now been
        seen ``min_count`` times on probation. They stay listed until :meth:`forget` (they may not get a row)."""
        at = torch.searchsorted(self.ids, ids).clamp(max=max(0, len(self.ids) - 1))
        found = (self.ids[at] == ids) if len(self.ids) else torch.zeros(len(ids), dtype=torch.bool, device="cpu")
        before = self.counts[at] if len(self.ids) else torch.zeros(len(ids), dtype=torch.int32, device="cpu")
        total = occurrences.to(torch.int32) + torch.where(found, before, torch.zeros_like(before))
        self.counts[at[found]] = total[found]
        self.last[at[found]] = round_
        new = ~found
        old_pos, new_pos = merge_sorted(self.ids, ids[new])
        self._set(self._merged(self.ids, ids[new], old_pos, new_pos), self._merged(self.counts, total[new], old_pos, new_pos),
                  self._merged(self.last, torch.full((int(new.sum()),), round_, dtype=torch.int64, device="cpu"),
                               old_pos, new_pos))
        return total >= self.min_count

    @staticmethod
    def _merged(a: torch.Tensor, b: torch.Tensor, a_pos: torch.Tensor, b_pos: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(a) + len(b), dtype=a.dtype, device="cpu")
        out[a_pos], out[b_pos] = a, b
        return out

    @torch.no_grad()
    def forget(self, ids: torch.Tensor) -> None:
        """``ids`` (sorted) hold rows now: off the list."""
        if not len(ids) or not len(self.ids):
            return
        at = torch.searchsorted(self.ids, ids).clamp(max=len(self.ids) - 1)
        keep = torch.ones(len(self.ids), dtype=torch.bool, device="cpu")
        keep[at[self.ids[at] == ids]] = False
        self._set(self.ids[keep], self.counts[keep], self.last[keep])

    @torch.no_grad()
    def trim(self) -> None:
        """At most ``capacity`` ids: the least recently seen leave first (all of a round at once, so perhaps a few
        more than needed; order-free, so every rank trims alike)."""
        excess = len(self.ids) - self.capacity
        if excess <= 0:
            return
        first = int(self.last.min())
        per_round = torch.bincount(self.last - first)
        cut = first + int(torch.searchsorted(torch.cumsum(per_round, 0), excess))  # rounds ≤ cut leave
        keep = self.last > cut
        self._set(self.ids[keep], self.counts[keep], self.last[keep])

    def _set(self, ids: torch.Tensor, counts: torch.Tensor, last: torch.Tensor) -> None:
        self.ids, self.counts, self.last = ids, counts, last

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in NAMES:  # the list's length is the source's
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args)
