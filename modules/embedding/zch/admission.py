"""Admission by frequency for ``model.zch`` (``model.zch.min_count``): a new id takes a row only once it has
been seen ``min_count`` times, as a vocabulary keeps only values seen ``min_count`` times; until then it reads
the table's unknown row with the other rare ids (DeepRec's counter filter for EmbeddingVariable is the same idea).

Counts are kept in a count-min sketch (Cormode & Muthukrishnan, J. Algorithms 2005): ``depth`` rows of ``width``
int32 counters; an occurrence of id x adds 1 to ``C[i, h_i(x)]`` in every row, and x's count is
``min_i C[i, h_i(x)]`` — never below the true count, above it only when x collides with frequent ids in every
row (then it is admitted early: harmless). ``h_i(x) = ((x · a_i) mod 2^64) >> (64 − log2 width)`` with odd
multipliers ``a_i`` (multiplicative hashing, Knuth TAOCP 6.4). The ids are already table-salted 63-bit hashes
(:func:`pipeline.data.encoding.raw_ids`), so one sketch serves every table. Memory: ``depth × width × 4`` bytes
(2 × 2^21: 16 MiB), whatever the number of ids; counts accumulate over the run and across days (they are
part of the mapping a model folder keeps).
"""

from __future__ import annotations

import torch
from torch import nn

MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)  # odd 64-bit constants (golden ratio; xxHash's prime 2)
WIDTH_BITS = 21


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


class CountMinAdmission(nn.Module):
    """Occurrence counts of ids (a count-min sketch, module docstring) and the admission test on them."""

    def __init__(self, min_count: int, width_bits: int = WIDTH_BITS) -> None:
        super().__init__()
        self.min_count = min_count
        self.shift = 64 - width_bits
        self.register_buffer("counts", torch.zeros(len(MULTIPLIERS), 1 << width_bits, dtype=torch.int32))
        self.multipliers = [_signed(a) for a in MULTIPLIERS]

    def _slots(self, ids: torch.Tensor) -> list[torch.Tensor]:
        # int64 multiplication wraps mod 2^64; the top bits, read unsigned, pick the counter
        mask = (1 << (64 - self.shift)) - 1
        return [((ids * a) >> self.shift) & mask for a in self.multipliers]

    @torch.no_grad()
    def admitted(self, ids: torch.Tensor, occurrences: torch.Tensor) -> torch.Tensor:
        """Count ``occurrences`` of each of the (distinct) ``ids`` (int64), then: whether each has been seen
        ``min_count`` times so far, these included."""
        slots = self._slots(ids)
        for row, s in zip(self.counts, slots):
            row.index_add_(0, s, occurrences.to(torch.int32))
        seen = torch.stack([row[s] for row, s in zip(self.counts, slots)]).min(dim=0).values
        return seen >= self.min_count
