"""Which way of its cache set each missed row takes: the row cache's eviction policy
(:mod:`modules.embedding.ssd_tier.row_cache`), over a set-associative slot array of ``W`` ways a set.

For the sets that missed rows in this call, each way is scored

    score[set, way] = −1                  the way is empty
                      +∞                  pinned: used at call ``hold`` or later (this call's rows; with an
                                          earlier ``hold``, those of a batch still under way too)
                      used                lru: the call that last used it
                      uses·2^40 + used    lfu (default): uses since admission, ties by last use

and the k-th missed row of a set (k = 0, 1, …) takes the way of rank k in ascending score (ties: the lower
way). More missed rows in a set than it has unpinned ways cannot all be resident: :class:`CacheTooSmallError`.

The scores are [sets, W] int64 temporaries: the sets are scored :data:`SETS_PER_CHUNK` at a time, so a
call's temporaries stay at tens of MB whatever its misses (scored all at once, a step of ~400,000
distinct rows held ~400 MB of them — more than the cache it was choosing slots in). Sets are
independent: chunking changes no choice.

:func:`place` is the whole per-row step in torch — lookup, hits touched, victims, the slots' bookkeeping — the
reference for (and the fallback of) its C loop, :mod:`modules.embedding.ssd_tier.native_loops`.

Sources: FBGEMM ``lxu_cache`` (LRU / LFU over cache sets, the GPU TBE's cache), HierarchicalKV (scored
eviction); LFU hit more than LRU on both id orders measured (``benchmarks/row_cache_policy.py``).
"""

from __future__ import annotations

import torch

POLICIES = ("lru", "lfu")
USE_BITS = 40              # lfu score: uses << 40 | last use
USE_CAP = 2 ** (63 - USE_BITS) - 1  # uses saturate here: the score stays below 2^63
SETS_PER_CHUNK = 1 << 14   # sets scored at once: [16,384, W] int64 temporaries (4 MB at W = 32)
LOOKUP_CHUNK = 1 << 16     # ids looked up in their sets at once: [65,536, W] temporaries (~20 MB), not [all ids, W]


class CacheTooSmallError(RuntimeError):
    """More distinct rows of one batch fall into one cache set than it has ways."""


def too_small(rows: int, ways: int, free: int, floor_hint: str) -> CacheTooSmallError:
    """The error for ``rows`` missed rows of one batch in a set of ``ways`` ways of which ``free`` are unpinned."""
    return CacheTooSmallError(f"row cache: {rows} rows of one batch fall into one set of {ways} ways ({free} free): "
                              f"the cache is too small for this batch: {floor_hint}")


def choose_ways(sets: torch.Tensor, keys: torch.Tensor, used: torch.Tensor, uses: torch.Tensor, hold: int,
                policy: str, floor_hint: str) -> torch.Tensor:
    """The slot (set·W + way) each missed row takes. ``sets`` [M] the missed rows' sets, ascending;
    ``keys`` / ``used`` / ``uses`` [S, W] the cache's key, last use and use count of every slot; a slot
    used at call ``hold`` or later is pinned; ``floor_hint`` ends the error message (what to raise). Returns [M] int64."""
    ways = keys.shape[1]
    uniq, counts = torch.unique_consecutive(sets, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(sets.numel(), device="cpu") - torch.repeat_interleave(starts, counts)
    victim = torch.empty_like(sets)
    for a in range(0, uniq.numel(), SETS_PER_CHUNK):
        chunk = uniq[a:a + SETS_PER_CHUNK]
        first, last = int(starts[a]), int(starts[a + chunk.numel() - 1] + counts[a + chunk.numel() - 1])
        last_use = used[chunk]
        pinned = (last_use >= hold) & (keys[chunk] >= 0)  # an empty way holds nothing to keep
        free = ways - pinned.sum(dim=1)
        over = counts[a:a + chunk.numel()] - free
        if bool((over > 0).any()):
            worst = int(over.argmax())
            raise too_small(int(counts[a + worst]), ways, int(free[worst]), floor_hint)
        score = last_use.long()
        if policy == "lfu":
            score |= uses[chunk].long() << USE_BITS
        score.masked_fill_(pinned, torch.iinfo(torch.int64).max).masked_fill_(keys[chunk] < 0, -1)
        need = counts[a:a + chunk.numel()]
        owner = torch.repeat_interleave(torch.arange(chunk.numel(), device="cpu"), need)
        victim[first:last] = chunk[owner] * ways + _lowest(score, need)[owner, rank[first:last]]
    return victim


def _lowest(score: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """[S, max need] the ways of each set in ascending score, ties by way — the order a stable sort gives —
    as far as its ``need``: by repeated ``argmin`` (the first minimum), the way taken masked with +∞. Sets
    rarely miss more than a few rows a call, so a few passes over [S, W] replace sorting every set.
    ``score`` is overwritten."""
    taken = torch.iinfo(torch.int64).max
    rank = torch.empty((score.shape[0], int(need.max())), dtype=torch.int64, device="cpu")
    sets = torch.arange(score.shape[0], device="cpu")
    for k in range(rank.shape[1]):
        if k:
            sets = sets[need[sets] > k]
        way = (score if k == 0 else score[sets]).argmin(dim=1)
        rank[sets, k] = way
        score[sets, way] = taken
    return rank


def place(ids: torch.Tensor, first: torch.Tensor, nsets: torch.Tensor, set_offset: torch.Tensor, keys: torch.Tensor,
          used: torch.Tensor, uses: torch.Tensor, dirty: torch.Tensor, clock: int, mark_dirty: bool, policy: str,
          floor_hint: str, hold: int) -> tuple[torch.Tensor, ...]:
    """The torch path of the row cache's per-row loop — :func:`modules.embedding.ssd_tier.native_loops.assign`'s
    contract (``cache_loops.c``'s header), and the reference it is tested against: unique ``ids`` (ascending)
    looked up :data:`LOOKUP_CHUNK` at a time, hits touched, then a victim for each miss (:func:`choose_ways`).
    Returns (slot, table, the misses' positions in ``ids``, their victims' old keys and dirty flags); the
    cache's ``keys`` / ``used`` / ``uses`` / ``dirty`` are updated in place."""
    if ids.numel() and int(ids[0]) < int(first[0]):  # ascending: the least first
        raise IndexError(f"row cache: id {int(ids[0])} is below the first table's first id {int(first[0])}: ids "
                         f"must be checked before the cache")
    table = torch.searchsorted(first, ids, right=True) - 1
    sets = set_offset[table] + (ids - first[table]) % nsets[table]
    ways = keys.shape[1]
    hit, slot, keyed = torch.empty(ids.numel(), dtype=torch.bool, device="cpu"), torch.empty_like(ids), ids.to(keys.dtype)
    for a in range(0, ids.numel(), LOOKUP_CHUNK):
        found, way = (keys[sets[a:a + LOOKUP_CHUNK]] == keyed[a:a + LOOKUP_CHUNK, None]).max(dim=1)
        hit[a:a + LOOKUP_CHUNK] = found  # a key sits in one way of its set at most
        slot[a:a + LOOKUP_CHUNK] = sets[a:a + LOOKUP_CHUNK] * ways + way
    hits = slot[hit]
    used.view(-1)[hits] = clock
    uses.view(-1)[hits] = torch.clamp(uses.view(-1)[hits] + 1, max=USE_CAP)  # the lfu score stays within int64
    if mark_dirty:
        dirty.view(-1)[hits] = True
    miss = torch.nonzero(~hit).view(-1)
    order = torch.argsort(sets[miss], stable=True)
    victim = torch.empty_like(miss)
    victim[order] = choose_ways(sets[miss][order], keys, used, uses, hold, policy, floor_hint)
    old, old_dirty = keys.view(-1)[victim].long(), dirty.view(-1)[victim].clone()
    keys.view(-1)[victim] = ids[miss].to(keys.dtype)
    used.view(-1)[victim], uses.view(-1)[victim], dirty.view(-1)[victim] = clock, 1, mark_dirty
    slot[miss] = victim
    return slot, table, miss, old, old_dirty
