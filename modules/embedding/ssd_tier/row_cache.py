"""A row cache in host memory in front of file-backed tables (the CPU ``ssd`` tier).

Rows — weights and optimizer state together — sit in slot arrays; FBGEMM's CPU kernel runs on the
slots with each id remapped to its slot (:mod:`modules.embedding.ssd_tier.cached_tbe`), so the update math is the
kernel's own. The cache is set-associative, as FBGEMM's ``lxu_cache`` is on GPU: each table has S_t
sets of ``W`` ways, and its row ℓ may sit in set ``ℓ mod S_t`` (hashed ids are spread already;
frequency-ordered ids put consecutive hot rows in different sets).
For each batch (unique ids, sorted), in one pass of C (:mod:`.native_loops`; where no C compiler is found,
the same in torch ops, :func:`.set_victims.place`):

    hit     keys[set, way] = ℓ                       → that slot
    miss    the unpinned way of its set that the policy ranks first (empty ways before all):
              lfu (default): fewest uses since admission, ties by lru;  lru: least recently used
              (LFU hit more on hashed and on frequency-ordered ids: :mod:`.set_victims`)
            a dirty victim is written back to the file first; the row is then read from the file —
            or, if it was never written there, drawn from its initialiser (:mod:`modules.embedding.row_init`):
            a file-backed table is never written whole, its file stays sparse until a checkpoint.

Rows of the batch under way are pinned (their last use is this call), so a batch's rows are all
resident when the kernel runs; more distinct rows of one batch in a set than ``W`` ways cannot be,
and is refused with a message (the cache is then too small for the batch: the pinned rows of one
batch need about a quarter of the slots at most, :data:`MIN_SLOTS_PER_ID`).

Evicted dirty rows go to sorted runs on disk (:mod:`modules.embedding.ssd_tier.sorted_runs`, an LSM store;
without one, home by a background thread); a miss is read from the runs (newest record), else from the
file through its shared memory map (:func:`modules.embedding.ssd_tier.files.mapped_file`), in file order.
:meth:`RowCache.flush` writes the runs home in one sweep in file order. The cache absorbs the repeated
updates of hot rows, the runs the scattered writes of rows met once. Which rows were ever written
back — to the runs or home — is one bit per row (``written``).

Anchors read, not copied: FBGEMM ``split_table_batched_embeddings_ops_training`` (lxu_cache,
LRU/LFU over sets), ColossalAI ``CachedEmbeddingBag`` (frequency-aware), HierarchicalKV (scored
eviction), OneFlow OneEmbedding (cached SSD store).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from modules.embedding.ssd_tier.backing import (MEMTABLE_PER_SLOTS, RUN_RECORDS_PER_SLOT, BackingTable, CacheStats,
                                                records, split_records)
from modules.embedding.ssd_tier.paged_records import prefetch_rows
from modules.embedding.ssd_tier import native_loops
from modules.embedding.ssd_tier.set_victims import POLICIES, place
from modules.embedding.ssd_tier.sorted_runs import SortedRuns

WAYS = 32
MIN_SLOTS_PER_ID = 4   # cache rows per distinct row of one batch: a set overflows about never (placement's floor)
BLOCK_ROWS = 1 << 16   # rows materialised at once
TOO_SMALL_HINT = (f"about {MIN_SLOTS_PER_ID}× its distinct rows per table are needed; raise topology.ssd.cache_mb "
                  f"or topology.ddr_cap_gb, or lower trainer.batch_size")  # ends CacheTooSmallError's message
INT32_KEY_ROWS = 2**31  # a cache whose tables hold fewer rows keys its slots with int32 (the lookup reads half the bytes)


class RowCache:
    """The row caches of one table batch's tables, as one set-associative structure: table t owns the sets
    ``[o_t, o_t + S_t)`` and a row ℓ of it sits in set ``o_t + ℓ mod S_t``; its slots are the rows of its slot
    table ``weights[t]`` ([S_t·W, D_t]) with optimizer state ``states[t]`` — what the kernel updates. Linear
    ids (``first[t]`` + row) name a (table, row) pair in one tensor, so a batch of every table is looked up
    and admitted with one set of vectorised operations (module docstring)."""

    def __init__(self, tables: Sequence[BackingTable], weights: Sequence[torch.Tensor],
                 states: Sequence[Sequence[torch.Tensor]], policy: str = "lfu", runs: Path | None = None,
                 native: bool | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"topology.ssd.cache_policy={policy!r}: expected one of {POLICIES}")
        if any(w.shape[0] % WAYS for w in weights):
            raise ValueError(f"row cache: every slot table holds whole sets of {WAYS} rows")
        self.tables, self.weights, self.states, self.policy = list(tables), list(weights), [list(s) for s in states], policy
        sets = [w.shape[0] // WAYS for w in weights]
        self.nsets = torch.tensor(sets, device="cpu")
        self.set_offset = torch.tensor([sum(sets[:t]) for t in range(len(sets))], device="cpu")
        self.first = torch.tensor([sum(t.rows for t in self.tables[:i]) for i in range(len(self.tables))], device="cpu")
        shape = (sum(sets), WAYS)
        rows = sum(t.rows for t in self.tables)
        self.keys = torch.full(shape, -1, dtype=torch.int32 if rows < INT32_KEY_ROWS else torch.int64, device="cpu")
        self.used = torch.zeros(shape, dtype=torch.int32, device="cpu")  # the call that last used the slot (2^31 calls)
        self.uses = torch.zeros(shape, dtype=torch.int32, device="cpu")
        self.dirty = torch.zeros(shape, dtype=torch.bool, device="cpu")
        self.written = np.zeros((rows + 7) // 8, dtype=np.uint8)  # bit per linear id
        self.clock = 0
        self.native = native_loops.available() if native is None else native  # the C loops (native_loops), else torch / numpy
        self.stats = CacheStats()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-cache-writer")
        self._pending: Future | None = None
        width = max(self._record_floats(t) for t in range(len(self.tables)))
        self.runs = SortedRuns(runs, width, self.slots // MEMTABLE_PER_SLOTS, self.native) if runs is not None else None

    @property
    def slots(self) -> int:
        return self.keys.numel()

    def local_slots(self, slots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Global slots (set·W + way) as rows of their tables' slot tables."""
        return slots - self.set_offset[table] * WAYS

    # -- the batch path ----------------------------------------------------------------------------
    def assign(self, ids: torch.Tensor, dirty: bool, hold: int | None = None,
               load: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(global slots, tables) of the linear ``ids`` (int64), loading the missing rows; ``dirty``: the kernel
        will update them (a training forward). A batch's ids arrive unique and ascending, as the loops need
        them; others (rows an optimizer term updates) are made so first. ``hold``: the rows used since that
        call stay too (a batch still under way: :mod:`.rows_ahead`); by default this call's own.
        ``load=False`` (with ``dirty``): the caller overwrites each row whole — weights and state, a row that
        starts afresh — so a missing row gets a slot but is not read (its slot holds the victim's values until
        then). Being dirty, the new values outlive any older record of the row: written back, they are the
        newest in the sorted runs; at a flush, dirty rows go home after the runs. Counted as drawn."""
        if not load and not dirty:
            raise ValueError("RowCache.assign(load=False) hands out rows for the caller to overwrite: dirty=True")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            unique, inverse = torch.unique(ids, return_inverse=True)
            slot, table = self.assign(unique, dirty, hold, load)
            return slot[inverse], table[inverse]
        self.clock += 1
        loop = native_loops.assign if self.native else place  # the same contract, in C or in torch
        slot, table, miss, old, old_dirty = loop(ids, self.first, self.nsets, self.set_offset, self.keys, self.used,
                                                 self.uses, self.dirty, self.clock, dirty, self.policy, TOO_SMALL_HINT,
                                                 hold=self.clock if hold is None else hold)
        self.stats.lookups += int(ids.numel())
        self.stats.hits += int(ids.numel() - miss.numel())
        if miss.numel():
            victim = slot[miss]
            back = old_dirty & (old >= 0)
            if bool(back.any()):
                self._write(old[back], victim[back])
            if load:
                self._read(ids[miss], victim)
            else:
                self.stats.rows_drawn += int(miss.numel())
        return slot, table

    # -- rows to and from the files -----------------------------------------------------------------
    def _spans(self, ids: torch.Tensor) -> list[tuple[int, int, int]]:
        """(table, start, stop) of each table's part of linear ``ids`` (ascending)."""
        bounds = torch.searchsorted(ids, torch.cat([self.first, self.first[-1:] + self.tables[-1].rows])).tolist()
        return [(t, a, b) for t, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if a < b]

    def _is_written(self, ids: torch.Tensor) -> torch.Tensor:
        i = ids.numpy()
        return torch.from_numpy(((self.written[i >> 3] >> (i & 7).astype(np.uint8)) & 1).astype(bool))

    def _mark_written(self, ids: torch.Tensor) -> None:
        """Set the bits of ``ids`` (ascending): each byte's bits or-ed together, then into it once."""
        i = ids.numpy()
        if not len(i):
            return
        byte, bits = i >> 3, (1 << (i & 7)).astype(np.uint8)
        starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
        self.written[byte[starts]] |= np.bitwise_or.reduceat(bits, starts)

    def _read(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Fill ``slots`` with rows ``ids`` (linear, ascending: a batch's misses): the newest evicted record from
        the sorted runs, else the row in its file (in file order) where it was written, else drawn from its
        initialiser."""
        written = self._is_written(ids)
        from_file = written.clone()
        if self.runs is not None and bool(written.any()):
            at = torch.nonzero(written).view(-1)
            found, values = self.runs.find(ids[at].numpy())
            at = at[torch.from_numpy(found)]
            self._fill(ids[at], slots[at], torch.from_numpy(values))
            from_file[at] = False
            self.stats.rows_read += int(at.numel())
        if bool(from_file.any()):
            self.drain()  # a row written home a moment ago may be among them
        for t, a, b in self._spans(ids):
            table, local = self.tables[t], slots[a:b] - self.set_offset[t] * WAYS
            rows, on_file, drawn = ids[a:b] - self.first[t], from_file[a:b], ~written[a:b]
            if bool(on_file.any()):
                r, s = rows[on_file], local[on_file]
                for file in (table.weights, *table.states):  # every page at once, then gathered
                    prefetch_rows(file, r.numpy())
                self.weights[t][s] = table.weights[r]
                for cache, file in zip(self.states[t], table.states):
                    cache[s] = file[r]
                self.stats.rows_read += int(r.numel())
            if bool(drawn.any()):
                r, s = rows[drawn], local[drawn]
                table.draw_into(self.weights[t], s, r)  # straight into the slots
                for cache in self.states[t]:
                    cache.index_fill_(0, s, 0.0)
                self.stats.rows_drawn += int(r.numel())

    def _fill(self, ids: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Slots ``slots`` of rows ``ids`` (ascending) from their ``records``."""
        for t, a, b in self._spans(ids):
            local = slots[a:b] - self.set_offset[t] * WAYS
            weights, states = split_records(records[a:b], self.weights[t].shape[1], self.states[t])
            self.weights[t][local] = weights
            for cache, values in zip(self.states[t], states):
                cache[local] = values

    def _record_floats(self, t: int) -> int:
        return self.weights[t].shape[1] + sum(s[0].numel() if s.dim() > 1 else 1 for s in self.states[t])

    def _write(self, ids: torch.Tensor, slots: torch.Tensor, home: bool = False) -> None:
        """Write ``slots`` back as rows ``ids`` (linear): into the sorted runs, or with ``home`` (or no runs) to
        their places in the files — in file order, by a writer thread while the step goes on (the slots'
        values are copied out now: they are about to be reused). They are clean afterwards; anything that
        reads the files waits for the writer (:meth:`drain`)."""
        order = torch.argsort(ids)
        ids, slots = ids[order], slots[order]
        spans = self._spans(ids)
        if self.runs is not None and not home:
            out = np.zeros((ids.numel(), self.runs.width), dtype=np.float32)
            for t, a, b in spans:
                local = slots[a:b] - self.set_offset[t] * WAYS
                data = records(self.weights[t][local], [cache[local] for cache in self.states[t]])
                out[a:b, :data.shape[1]] = data
            self.runs.put(ids.numpy(), out)
            if self.runs.records > RUN_RECORDS_PER_SLOT * self.slots:  # bounded: home, in one sweep
                self._runs_home()
        else:
            jobs = []
            for t, a, b in spans:
                local = slots[a:b] - self.set_offset[t] * WAYS
                jobs.append((self.tables[t], ids[a:b] - self.first[t], self.weights[t][local],
                             [cache[local] for cache in self.states[t]]))
            self.drain()
            self._pending = self._writer.submit(_store_rows, jobs)
        self._mark_written(ids)
        self.stats.rows_written += int(ids.numel())

    def _runs_home(self) -> None:
        """The sorted runs' rows written to their places in the files, in one sweep in file order; the runs emptied."""
        self.drain()
        self.runs.write_home(self._store_home)

    def _store_home(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Records of rows ``keys`` (linear, ascending) into their places in the files."""
        ids, values = torch.from_numpy(np.array(keys)), torch.from_numpy(np.array(values))  # a run's mapped bytes: copied
        for t, a, b in self._spans(ids):
            table = self.tables[t]
            weights, states = split_records(values[a:b], table.weights.shape[1], table.states)
            _store_rows([(table, ids[a:b] - self.first[t], weights, states)])

    def drain(self) -> None:
        """Wait for the write-back under way (and raise its error, if any)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    # -- the whole cache ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the sorted runs' rows home, then every dirty row (they stay cached, clean): the files hold
        every row written since the start."""
        if self.runs is not None:
            self._runs_home()
        slots = torch.nonzero(self.dirty.view(-1)).view(-1)
        if slots.numel():
            self._write(self.keys.view(-1)[slots].long(), slots, home=True)
            self.dirty.view(-1)[slots] = False
        self.drain()

    def materialise(self) -> None:
        """Make the files hold every row: :meth:`flush`, then draw the rows never written (in blocks; zero rows
        — the first-order tables, optimizer state — are what a sparse file reads already)."""
        self.flush()
        for t, table in enumerate(self.tables):
            if table.init.std != 0.0:
                for a in range(0, table.rows, BLOCK_ROWS):
                    rows = torch.arange(a, min(table.rows, a + BLOCK_ROWS), device="cpu")
                    fresh = rows[~self._is_written(rows + self.first[t])]
                    if fresh.numel():
                        table.draw_into(table.weights, fresh, fresh)
        self.written[:] = 0xFF

    def invalidate(self) -> None:
        """Forget every slot without writing it back: the files were written from outside (a checkpoint
        or ``init_from`` loaded into them) and hold every row."""
        self.drain()
        if self.runs is not None:
            self.runs.clear()  # what they held is stale
        self.keys.fill_(-1)
        self.dirty.fill_(False)
        self.used.zero_()
        self.uses.zero_()
        self.written[:] = 0xFF


def _store_rows(jobs: list[tuple[BackingTable, torch.Tensor, torch.Tensor, list[torch.Tensor]]]) -> None:
    """The writer thread's work: rows (sorted by file offset) and their state into the files."""
    for table, rows, weights, states in jobs:
        table.weights[rows] = weights
        for file, values in zip(table.states, states):
            file[rows] = values
