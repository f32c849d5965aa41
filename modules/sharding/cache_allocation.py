"""Host memory shared between whole tables and row caches by the lookups each byte serves (CPU tiers).

A table t read by n_t ids per sample, whose r hottest rows carry a share H_t(r) of its lookups, serves
n_t · H_t(r) of a sample's lookups from host memory when a row cache of r slots sits in front of its
``ssd`` files (an LFU cache keeps the hottest rows: docs/ssd_tier.md), and all n_t when the
whole table is in host memory. With a host budget B, choose for every table either host memory or
``ssd`` with r_t cache rows to

    maximise  Σ_t n_t · H_t(r_t)    subject to   Σ_t cost_t(r_t) ≤ B,   r_t ≥ floor_t,

    cost_t(r)      = r · slot_t + index_t      (on ssd: r slots, each its row and bookkeeping, and the index)
    cost_t(rows_t) = rows_t · row_t            (in host memory: the rows alone, no slot, no index)

H_t is the id-frequency curve preprocessing measures (``coverage_rows``: the rows carrying 50, 80, 90,
95 and 99 % of the occurrences), linear between those points and 1 at rows_t (placement gives a table
without statistics, raw ids, the points of Zipf's law: :mod:`modules.zipf`). H_t is concave (the counts are sorted), so taking the
steps of all curves in order of lookups gained per byte, each while it fits, solves the problem with
fractional rows (the greedy of the fractional knapsack; the same marginal-utility rule partitions a
shared cache in Qureshi & Patt, "Utility-Based Cache Partitioning", MICRO 2006). The last step of a
table that may live in host memory is the move there: it gains n_t · (1 − H_t(r)) for rows_t · row_t
less what its slots and index already cost. That step is all or nothing, which the fractional greedy
does not see; a local search mends it (:func:`allocate`). With uniform curves this keeps the smallest
tables whole in host memory and gives the rest to the next smallest's cache, as placement did before
by size alone; with measured ones, a table whose lookups a few rows carry goes behind a cache holding
those rows, and the bytes its cold rows took serve other tables' lookups.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Claim:
    """One table's options: ``curve`` — (rows, share of lookups) points from (0, 0) rising to (rows, 1)."""

    name: str
    rows: int
    lookups: float        # ids per sample reading the table (its features)
    curve: tuple[tuple[int, float], ...]
    row_bytes: float      # a row with its optimizer state, in host memory
    slot_bytes: float     # a row cache slot
    index_bytes: float    # the table's index when on ssd
    floor: int            # the least cache rows on ssd
    may_host: bool = True

    @property
    def host_bytes(self) -> float:
        return self.rows * self.row_bytes

    def cache_cost(self, r: int) -> float:
        return r * self.slot_bytes + self.index_bytes

    def share(self, r: float) -> float:
        """H(r): the share of the table's lookups its ``r`` hottest rows carry."""
        for prev, point in zip(self.curve, self.curve[1:]):
            if r < point[0]:
                return prev[1] + (point[1] - prev[1]) * (r - prev[0]) / (point[0] - prev[0])
        return 1.0

    def starts_in_host(self) -> bool:
        """The whole table costs no more than its least cache: it never goes to ssd."""
        return self.may_host and self.host_bytes <= self.cache_cost(min(self.floor, self.rows))


def coverage_curve(rows: int, coverage_rows: Mapping[float, int]) -> tuple[tuple[int, float], ...]:
    """H's points from ``coverage_rows`` (share → hottest rows carrying it), clipped to ``rows``; a share
    reached at no more rows than the one before adds to that point. Uniform without statistics."""
    points = [(0, 0.0)]
    for q in sorted(coverage_rows):
        r = min(rows, max(1, int(coverage_rows[q])))
        if r > points[-1][0]:
            points.append((r, float(q)))
        else:
            points[-1] = (points[-1][0], max(points[-1][1], float(q)))
    if points[-1][0] < rows:
        points.append((rows, 1.0))
    else:
        points[-1] = (rows, 1.0)
    return tuple(points)


def _start(c: Claim, hosted: frozenset[str]) -> int | None:
    """A table's least option: host memory (None) if asked or cheaper than its least cache, else that cache."""
    return None if c.starts_in_host() or c.name in hosted else min(c.floor, c.rows)


def _cost(c: Claim, r: int | None) -> float:
    return c.host_bytes if r is None else c.cache_cost(r)


def least_bytes(claims: Sequence[Claim], hosted: frozenset[str] = frozenset()) -> float:
    """What the tables need at least (those in ``hosted`` whole): each whole where that is cheaper than its
    least cache, else that cache."""
    return sum(_cost(c, _start(c, hosted)) for c in claims)


def allocate(claims: Sequence[Claim], budget: float) -> dict[str, int | None]:
    """Each table's row cache rows, or None for host memory (see the module docstring); with a ``budget``
    below :func:`least_bytes`, each table's least (the caller says what is missing).

    The move to host memory is all or nothing, so the greedy alone can spend on caches the bytes a whole
    table needed (a table 95 % of the way to host memory grown as slots instead); a local search mends
    that: tables are put in host memory one at a time beforehand while that serves more lookups."""
    best = _greedy(claims, budget, frozenset())
    while True:
        hosted = frozenset(name for name, r in best.items() if r is None)
        trials = [_greedy(claims, budget, hosted | {c.name}) for c in claims
                  if c.may_host and c.name not in hosted and least_bytes(claims, hosted | {c.name}) <= budget]
        better = max(trials, key=lambda s: served(claims, s), default=None)
        if better is None or served(claims, better) <= served(claims, best) + 1e-12:
            return best
        best = better


def served(claims: Sequence[Claim], state: Mapping[str, int | None]) -> float:
    """Lookups per sample served from host memory: n_t in host memory, n_t · H_t(r) behind a cache of r rows."""
    return sum(c.lookups * (1.0 if state[c.name] is None else c.share(state[c.name])) for c in claims)


def _greedy(claims: Sequence[Claim], budget: float, hosted: frozenset[str]) -> dict[str, int | None]:
    """Steps by lookups gained per byte while they fit, the tables in ``hosted`` whole from the start."""
    by_name = {c.name: c for c in claims}
    state = {c.name: _start(c, hosted) for c in claims}
    left = budget - least_bytes(claims, hosted)
    heap: list[tuple[float, int, str, int | None, float]] = []  # (−gain per byte, order, table, rows or None, cost)
    order = 0

    def push(c: Claim, r: int, promote: bool = True) -> None:
        """The table's next step: to the later option (a curve point, or host memory) that gains the most
        lookups per byte — a walk along the upper hull of its (bytes, lookups) options, so that a step
        never hides a steeper one behind it (the move to host memory can be steeper than the last rows)."""
        nonlocal order
        if r >= c.rows:
            return
        options = [(p[0], (p[0] - r) * c.slot_bytes, c.lookups * (p[1] - c.share(r))) for p in c.curve if p[0] > r]
        if c.may_host and promote:
            options.append((None, c.host_bytes - c.cache_cost(r), c.lookups * (1.0 - c.share(r))))
        per_byte = lambda o: math.inf if o[1] <= 0 else o[2] / o[1]  # noqa: E731
        target, cost, gain = max(options, key=per_byte)
        density = per_byte((target, cost, gain))
        heapq.heappush(heap, (-density, order, c.name, target, cost))
        order += 1

    for name, r in state.items():
        if r is not None:
            push(by_name[name], r)
    while heap:
        _, _, name, target, cost = heapq.heappop(heap)
        c, r = by_name[name], state[name]
        assert r is not None
        if cost <= left:
            left -= cost
            state[name] = target
            if target is not None:
                push(c, target)
        elif target is None:  # the move to host memory does not fit: grow the cache along the last segment
            push(c, r, promote=False)
        else:  # part of the segment: as many slots as are left
            grow = min(target - r, int(left // c.slot_bytes))
            if grow > 0:
                state[name] = r + grow
                left -= grow * c.slot_bytes
    return state
