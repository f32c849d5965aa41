"""Training batches for a GPU: built in a background thread into reused page-locked buffers, two batches ahead.

A one-hot training batch of ``b`` rows and ``F`` id features is three host tensors: dense [b, D] float32, ids [F·b]
(feature-major, the KeyedJaggedTensor's values) and labels [b] float32; its lengths are all 1, the same tensor for
every batch (:func:`constant_lengths`: made once per size and device, never copied again). A :class:`BatchRing` holds
``slots`` such sets of tensors, allocated once (page-locked where CUDA is present: the host → device copy is then
asynchronous, and no step pins fresh memory). The loader's thread takes a free slot, gathers the rows of the store
straight into it (no second copy) and checks the ids against their tables there (off the training thread, and on
host tensors only: no device synchronisation). The training thread's :meth:`Slot.release`, called once the batch
has been copied to the device, records a CUDA event after the copy; the slot is filled again only once that event
has passed, so no copy in flight is overwritten. On the CPU, where a batch moved to the CPU is not copied, the batch
leaves its slot as a copy before the slot is released.

Slots needed: the loader's queue (2) + the batch it builds (1) + the one the trainer fetched ahead (1) + the one
being copied (1): 5.
"""

from __future__ import annotations

import queue
import threading
from typing import Sequence

import numpy as np
import torch

SLOTS = 5
_LENGTHS: dict[tuple[int, str], torch.Tensor] = {}
_LENGTHS_LOCK = threading.Lock()


def constant_lengths(n: int, device: torch.device | str) -> torch.Tensor:
    """A [n] int32 tensor of ones on ``device``, made once per (n, device): the lengths of every one-hot batch."""
    key = (n, str(device))
    with _LENGTHS_LOCK:
        if key not in _LENGTHS:
            _LENGTHS[key] = torch.ones(n, dtype=torch.int32, device=device)
        return _LENGTHS[key]


class Slot:
    """One batch's host tensors: ``dense`` [b, D], ``ids`` [F·b], ``labels`` [b]."""

    def __init__(self, ring: "BatchRing", rows: int, dense_dim: int, features: int, id_dtype: torch.dtype,
                 pin: bool) -> None:
        self.ring = ring
        self.dense = torch.empty(rows, dense_dim, dtype=torch.float32, pin_memory=pin)
        self.ids = torch.empty(features * rows, dtype=id_dtype, pin_memory=pin)
        self.labels = torch.empty(rows, dtype=torch.float32, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None

    def release(self, device: torch.device) -> None:
        """Back to the ring once what was queued on ``device``'s current stream (the copy out of it) has run."""
        if device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.ring.put_back(self)


class BatchRing:
    """``slots`` reusable batch buffers for batches of ``rows`` rows (page-locked with ``pin``)."""

    def __init__(self, rows: int, dense_dim: int, features: int, id_dtype: np.dtype, pin: bool,
                 slots: int = SLOTS) -> None:
        self.rows, self.features = rows, features
        dtype = torch.from_numpy(np.zeros(0, dtype=id_dtype)).dtype
        self._free: queue.Queue[Slot] = queue.Queue()
        self.slots = [Slot(self, rows, dense_dim, features, dtype, pin) for _ in range(slots)]
        for slot in self.slots:
            self._free.put(slot)
        self._gather = np.empty((rows, features), dtype=id_dtype)  # the store's row-major ids, before the transpose
        self.closed = threading.Event()

    def put_back(self, slot: Slot) -> None:
        self._free.put(slot)

    def acquire(self) -> Slot | None:
        """A free slot whose last copy has run; None once the ring is closed (the iteration ended)."""
        while not self.closed.is_set():
            try:
                slot = self._free.get(timeout=0.1)
            except queue.Empty:
                continue
            if slot.copied is not None:
                slot.copied.synchronize()  # this thread waits; the training thread does not
                slot.copied = None
            return slot
        return None

    def fill(self, slot: Slot, sparse: np.ndarray, dense: np.ndarray, labels: np.ndarray, rows: np.ndarray) -> None:
        """Rows ``rows`` of the store's arrays (ids [N, F], dense [N, D], labels [N]) into ``slot``: the ids
        feature-major."""
        np.take(sparse, rows, axis=0, out=self._gather)
        slot.ids.numpy().reshape(self.features, self.rows)[...] = self._gather.T
        np.take(dense, rows, axis=0, out=slot.dense.numpy())
        slot.labels.numpy()[...] = np.take(labels, rows)  # int8 → float32


def check_ids_in_slot(slot: Slot, keys: Sequence[str], table_rows: np.ndarray) -> None:
    """Every id of ``slot`` inside its key's table (``table_rows`` [F]); raises
    :class:`modules.embedding.lookup_inputs.IdOutOfRangeError` naming the first feature outside. Host arrays only."""
    from modules.embedding.lookup_inputs import IdOutOfRangeError

    ids = slot.ids.numpy().reshape(len(keys), -1)
    lo, hi = ids.min(axis=1), ids.max(axis=1)
    bad = np.flatnonzero((lo < 0) | (hi >= table_rows))
    if len(bad):
        k = int(bad[0])
        wrong = ids[k][(ids[k] < 0) | (ids[k] >= table_rows[k])][0]
        raise IdOutOfRangeError(f"feature {keys[k]!r}: id {int(wrong)} is outside its table's rows "
                                f"[0, {int(table_rows[k])})")
