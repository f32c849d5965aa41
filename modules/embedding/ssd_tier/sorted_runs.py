"""Evicted dirty rows kept as sorted runs on disk — a log-structured merge (LSM) store — until the table
files are brought up to date.

    evicted rows ─► memtable (in memory, ≤ M records)
                    ─ full ─► a run: its keys sorted (one file), and the records in pages, each after
                              its key (another) — sequential writes
    runs of one tier, F of them ─► one run of the next tier (a merge: F runs read and one written, in key order)
    a row missed again: the memtable, else the runs newest first, each asked only if its Bloom filter
                        may hold the key (:mod:`.bloom`): the run's fences (each page's first key, in
                        memory) give its page, the keys inline there its record
    flush, or the runs past RUN_RECORDS_PER_SLOT records a cache slot: the memtable and every run merged
                        in key order into the home files — one sweep in file order

A key is a row's linear id (the first row of its table in the cache + the row); a record is its weights
and optimizer state, float32, padded to the widest table of the cache. The newest record of a key wins.

Why. Written to its home at once, an evicted row of a hashed or long-tailed table lands at a scattered
place: each dirties (and in a sparse file allocates) a 4 KiB page of its own, and under a memory limit
the kernel writes pages back before it can reclaim them — about 60× the bytes changed at 68-byte rows.
A log bounded by an in-memory index and written home when full did the same write in bursts: 0.045×
the in-memory speed with frequency-ordered tables 2× the memory, where every row of the table is met,
updated and evicted once an epoch (docs/ssd_tier.md). Sorted, every byte moves in order: appended runs,
sequential merges, and one sweep of the files when something reads them.

Cost: a record is rewritten once per tier, about log_F(records since the flush / M) + 1 times; the runs
hold the evicted rows on disk until the flush (with the duplicates of tiers not yet merged), at most
16 records a cache slot; a lookup reads one page in the run that holds the key (and in about 2 % of the
others: the filters' false positives; a record never straddles two pages: :class:`PagedRecords`);
the pages all rows of a lookup need are asked of the kernel at once (``madvise(WILLNEED)``), so the
disk reads them in parallel where page faults would read them one at a time; the mappings take no
read-around (``MADV_RANDOM``). Memory: the filters (8 bits a record), the fences (8 bytes per page of
records), the memtable and one merge block (F × :data:`BLOCK` records) — per cache slot, counted by
placement (:func:`modules.embedding.ssd_tier.backing.slot_bytes`); the runs are memory-mapped (page
cache, clean, reclaimable).

F = 16: with the filters, a lookup reads from one run whatever their number; merges drop duplicates and
keep the runs few, and compete with lookups for the disk (a merge thread busy 44 % of a 2× run at
F = 4). At F = 16 the 2× frequency-ordered benchmark ran 17 % faster than at F = 4 (15,067 against
12,849 samples/s, 400 steps, docs/ssd_tier.md; then with a byte per table row naming each key's run
instead of the filters, which at tables 8× the limit took more memory than the caches).

Sources: O'Neil, Cheng, Gawlick, O'Neil, "The Log-Structured Merge-Tree (LSM-Tree)", Acta Informatica
1996; size-tiered compaction as in Bigtable, Cassandra and RocksDB's universal compaction.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from modules.embedding.ssd_tier.bloom import BloomFilter
from modules.embedding.ssd_tier.paged_records import PagedRecords, mapped, paged, per_page

FAN_IN = 16            # runs of one tier merged into one of the next
BLOCK = 1 << 13        # keys of one run in one block of a merge
MEMTABLE_CHUNKS = 16   # the memtable's batches of records compacted into one past this


@dataclass
class Run:
    """A sorted run on disk: ``keys`` int64 [n] ascending and unique (read in order by merges), ``records`` in
    pages with their keys inline (:class:`PagedRecords`, read by lookups), both memory-mapped; each page's
    first key (``fences``) and a Bloom filter of its keys in memory."""

    keys: np.ndarray
    records: PagedRecords
    fences: np.ndarray
    bloom: BloomFilter
    tier: int
    paths: tuple[Path, Path]

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found [n] bool, their records) of ``keys`` ascending: the filter first, a page read for the rest."""
        found = self.bloom.may_hold(keys)
        hit, records = self.records.find(keys[found], self.fences)
        found[found] = hit
        return found, records


Source = tuple[np.ndarray, np.ndarray]  # (keys ascending and unique, records): a run or a memtable batch


def newest_wins(sources: Sequence[Source]) -> Source:
    """The union of ``sources`` (newest first) as one sorted source, each key's record from the newest."""
    if len(sources) == 1:
        return sources[0]
    keys = np.concatenate([k for k, _ in sources])
    keys, first = np.unique(keys, return_index=True)  # first occurrence: the newest source's
    return keys, np.concatenate([r for _, r in sources])[first]


def merged_blocks(sources: Sequence[Source]) -> Iterator[Source]:
    """:func:`newest_wins` of ``sources`` (newest first), in blocks of ascending keys: each block takes at most
    :data:`BLOCK` keys of any source, so a merge of runs larger than memory reads each one in order."""
    sources = [s for s in sources if len(s[0])]
    if not sources:
        return
    edges = np.unique(np.concatenate([k[::BLOCK] for k, _ in sources]))
    edges = np.append(edges, np.iinfo(np.int64).max)
    for lo, hi in zip(edges[:-1], edges[1:]):
        parts = []
        for keys, records in sources:
            a, b = np.searchsorted(keys, [lo, hi])
            if a < b:
                parts.append((np.asarray(keys[a:b]), np.asarray(records[a:b])))
        if parts:
            yield newest_wins(parts)


class SortedRuns:
    """The evicted records of one row cache (module docstring): :meth:`put` them, :meth:`find` them again,
    :meth:`write_home` them. Merges run in a background thread; the list of runs changes under a lock."""

    def __init__(self, stem: Path, width: int, memtable_records: int, native: bool = False) -> None:
        self.stem, self.width, self.capacity = Path(stem), width, max(1, memtable_records)
        self.native = native  # filters and lookups in C (:mod:`.native_loops`)
        self.memtable: list[Source] = []  # oldest first
        self.memtable_records = 0
        self.runs: list[Run] = []         # newest first; tiers never decrease from newest to oldest
        self._lock = threading.Lock()
        self._merger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-cache-merge")
        self._merging: Future | None = None
        self._names = itertools.count()

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Evicted rows: ``keys`` ascending and unique, ``records`` [n, width] float32, newer than all before."""
        self.memtable.append((keys, records))
        self.memtable_records += len(keys)
        if self.memtable_records >= self.capacity:
            self._seal()
        elif len(self.memtable) > MEMTABLE_CHUNKS:
            self.memtable = [newest_wins(self.memtable[::-1])]

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found [n] bool, the found keys' newest records [found, width]) for ``keys`` ascending."""
        found = np.zeros(len(keys), dtype=bool)
        out = np.empty((len(keys), self.width), dtype=np.float32)
        for src_keys, src_records in self.memtable[::-1]:
            left = np.flatnonzero(~found)
            at = np.minimum(np.searchsorted(src_keys, keys[left]), len(src_keys) - 1)
            hit = src_keys[at] == keys[left]
            out[left[hit]] = src_records[at[hit]]
            found[left[hit]] = True
        with self._lock:
            runs = list(self.runs)
        for run in runs:
            left = np.flatnonzero(~found)
            if not len(left):
                break
            hit, records = run.find(keys[left])
            out[left[hit]] = records
            found[left[hit]] = True
        return found, out[found]

    @property
    def records(self) -> int:
        """Records in the runs and the memtable (a key evicted twice counts twice until a merge)."""
        return self.memtable_records + sum(len(r.keys) for r in self.runs)

    def write_home(self, store: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Hand every key's newest record to ``store`` in blocks of ascending keys, then empty the store."""
        self.wait()
        for keys, records in merged_blocks([*self.memtable[::-1], *((r.keys, r.records) for r in self.runs)]):
            store(keys, records)
        self.clear()

    def clear(self) -> None:
        """Forget every record (the files hold them, or they are stale) and delete the run files."""
        self.wait()
        for run in self.runs:
            self._delete(run)
        self.runs, self.memtable, self.memtable_records = [], [], 0

    def wait(self) -> None:
        """Wait for the merges under way (and raise their error, if any)."""
        if self._merging is not None:
            merging, self._merging = self._merging, None
            merging.result()

    # -- runs -------------------------------------------------------------------------------------
    def _seal(self) -> None:
        run = self._write_run(0, [newest_wins(self.memtable[::-1])])
        with self._lock:
            self.runs = [run, *self.runs]
        self.memtable, self.memtable_records = [], 0
        if self._merging is None or self._merging.done():
            self.wait()
            self._merging = self._merger.submit(self._compact)

    def _compact(self) -> None:
        """Merge the oldest :data:`FAN_IN` runs of a tier that has that many, until none has."""
        while True:
            with self._lock:
                runs = list(self.runs)
            tiers = [r.tier for r in runs]
            full = [t for t in sorted(set(tiers)) if tiers.count(t) >= FAN_IN]
            if not full:
                return
            last = max(i for i, r in enumerate(runs) if r.tier == full[0])  # the tier's oldest run
            group = runs[last - FAN_IN + 1:last + 1]                         # contiguous: tiers are ordered
            merged = self._write_run(full[0] + 1, merged_blocks([(r.keys, r.records) for r in group]))
            with self._lock:
                at = next(i for i, r in enumerate(self.runs) if r is group[0])
                self.runs = [*self.runs[:at], merged, *self.runs[at + FAN_IN:]]
            for run in group:
                self._delete(run)

    def _write_run(self, tier: int, blocks: Iterable[Source]) -> Run:
        """A run's two files written in order, block by block, under temporary names then renamed."""
        name = next(self._names)
        paths = (self.stem.with_name(f"{self.stem.name}.run{name}.keys"),
                 self.stem.with_name(f"{self.stem.name}.run{name}.records"))
        temps = [p.with_name(p.name + ".tmp") for p in paths]
        k, n, fences = per_page(self.width), 0, []
        short: Source = (np.zeros(0, np.int64), np.zeros((0, self.width), np.float32))  # less than a page
        with open(temps[0], "wb") as kf, open(temps[1], "wb") as rf:
            for keys, records in blocks:
                keys = np.ascontiguousarray(keys, dtype=np.int64)
                kf.write(keys.tobytes())
                fences.append(keys[(-n) % k::k])  # the first key of each page
                n += len(keys)
                keys, records = np.concatenate([short[0], keys]), np.concatenate([short[1], records])
                whole = len(keys) // k * k
                rf.write(paged(keys[:whole], records[:whole], self.width))
                short = keys[whole:], records[whole:]
            rf.write(paged(*short, self.width))
        for temp, path in zip(temps, paths):
            os.replace(temp, path)
        if not n:
            empty = np.zeros(0, np.int64)
            return Run(empty, PagedRecords(None, 0, self.width), empty, BloomFilter(empty, self.native), tier, paths)
        keys_map, records_map = mapped(paths[0], at_random=False), mapped(paths[1], at_random=True)
        keys = np.frombuffer(keys_map, dtype=np.int64)
        bloom = BloomFilter(keys, self.native)  # the keys just written: still in the page cache
        return Run(keys, PagedRecords(records_map, n, self.width, self.native), np.concatenate(fences), bloom, tier,
                   paths)

    def _delete(self, run: Run) -> None:
        """The run's files unlinked; views of it a lookup still holds stay valid (its maps close with them)."""
        for path in run.paths:
            path.unlink(missing_ok=True)
