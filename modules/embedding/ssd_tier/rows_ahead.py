"""The next batch's rows brought into a row cache while the current step computes.

A step's cache work — its rows looked up, victims chosen and written back, missed rows read or drawn
(:mod:`.row_cache`) — sits on the step's path: FBGEMM's kernel needs every row of the batch in a slot.
When the next batch's ids are known (one process: :func:`modules.embedding.ssd_tier.cached_tbe.bring_ahead`),
that work runs in a thread while the current step's dense forward, backward and optimizer step run:

    step i     forward: batch i's slots — the thread's result if it brought exactly these ids, else assigned now
               → the thread starts on batch i+1: assign(ids_{i+1}, hold = the call that brought batch i)
               → dense forward, backward (FBGEMM updates batch i's slots), optimizer step
    step i+1   forward: waits for the thread, takes its result

Exactness: ``hold`` pins batch i's rows (their slots change in the backward while the thread runs) as
well as the thread's own; any other use of the cache waits for the thread first and, while its result
is not taken, keeps those rows too (:meth:`RowsAhead.beside`: the every-row L2 catches up a batch's rows
before its forward); a result taken has its rows marked dirty again (a checkpoint in between wrote them
back clean, and the batch is about to update them). The thread only moves rows between the files and
slots — it never changes a value — so a result not taken (the ids differ: the end of an epoch, an
evaluation batch, a set too full for two batches' rows) costs time, not exactness: the batch is then
assigned as without look-ahead.

On with ``topology.ssd.look_ahead=true`` (off by default: on 2 cores it gained a few per cent on one table
and lost on another, docs/ssd_tier.md). The sources of the idea: TorchRec's ``PrefetchTrainPipelineSparseDist``
(UVM caches filled for the next batch while the current one trains) and FBGEMM's ``prefetch_pipeline``
(rows of batches in flight locked).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from modules.embedding.ssd_tier.row_cache import RowCache
from modules.embedding.ssd_tier.set_victims import CacheTooSmallError

Slots = tuple[torch.Tensor, torch.Tensor]  # (global slots, tables) of unique ids (RowCache.assign)
BatchSlots = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # and each of the batch's ids' place among them


class RowsAhead:
    """One row cache's look-ahead (module docstring): :meth:`start` with the next batch's linear ids after
    the current batch's :meth:`batch`; any other use of the cache through :meth:`beside`."""

    def __init__(self, cache: RowCache) -> None:
        self.cache = cache
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-cache-ahead")
        self._ids: torch.Tensor | None = None  # the ids the thread brings (or brought) in
        self._job: Future | None = None
        self._result: BatchSlots | None = None
        self._made_at: int | None = None       # the cache call that brought them: kept until taken
        self._batch_at: int | None = None      # the call that brought the batch under way
        self.taken = self.dropped = 0          # results used / not used

    def start(self, ids: torch.Tensor) -> None:
        """Bring the linear ``ids`` of the next training batch in, in the thread (made unique there too: the
        forward that takes the result only compares its ids)."""
        self.drop()
        hold = self.cache.clock if self._batch_at is None else self._batch_at
        self._ids, self._job = ids, self._thread.submit(self._bring, ids, hold)

    def _bring(self, ids: torch.Tensor, hold: int) -> BatchSlots | None:
        unique, inverse = torch.unique(ids, return_inverse=True)
        try:
            return (*self.cache.assign(unique, dirty=True, hold=hold), inverse)
        except CacheTooSmallError:  # two batches' rows do not fit a set: the batch is assigned when it comes
            return None

    def batch(self, ids: torch.Tensor, dirty: bool) -> BatchSlots:
        """(slots, tables) of a batch's unique linear ids and each of ``ids``' place among them: the thread's
        result if it brought these ids for training, else assigned now."""
        self.wait()
        if dirty and self._result is not None and torch.equal(self._ids, ids):
            slots, self._batch_at = self._result, self._made_at
            self.cache.dirty.view(-1)[slots[0]] = True  # a checkpoint since may have written them back: clean
            self.taken += 1
            self._clear()
            return slots
        self.drop()
        unique, inverse = torch.unique(ids, return_inverse=True)
        slots, tables = self.cache.assign(unique, dirty)
        self._batch_at = self.cache.clock
        return slots, tables, inverse

    def beside(self, ids: torch.Tensor, dirty: bool, load: bool = True) -> Slots:
        """Another use of the cache (the every-row L2's catch-up, a row reset: ``load`` as in
        :meth:`RowCache.assign`): a pending result's rows are kept — unless they and ``ids``' rows do not fit a
        set together: then the result is dropped."""
        hold = self.hold()
        if hold is not None:
            try:
                return self.cache.assign(ids, dirty, hold=hold, load=load)
            except CacheTooSmallError:
                self.drop()
        return self.cache.assign(ids, dirty, load=load)

    def hold(self) -> int | None:
        """Wait for the thread; the call whose rows another use of the cache must keep (None: its own only)."""
        self.wait()
        return self._made_at if self._result is not None else None

    def drop(self) -> None:
        """Wait for the thread and forget its result (before the slots are forgotten, or a new start)."""
        self.wait()
        if self._ids is not None:
            self.dropped += 1
        self._clear()

    def wait(self) -> None:
        """Wait for the thread (its result, if any, stays to be taken; its error is raised here)."""
        if self._job is not None:
            job, self._job = self._job, None
            try:
                self._result = job.result()
            except BaseException:
                self._clear()
                raise
            self._made_at = self.cache.clock

    def _clear(self) -> None:
        self._ids = self._result = self._made_at = None
