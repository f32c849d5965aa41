"""What :class:`modules.embedding.sparse_arch.SparseArch` feeds its collections and does with their rows.

Tables that share one physical table at row offsets (the first-order table, and the stacked table of
``model.stack_tables``) are read with ids shifted into their rows:

    key f                 ids_f + o_f  if f's own table is stacked, else ids_f
    key wide_f (added)    ids_f + o_f                              (rows of the first-order table)

``o_f`` is the first row of f's table (:func:`modules.embedding.sparse_arch.wide_row_offsets`); both shared tables
lay the same tables out in the same order, so one shift serves both. The stacked table's rows are
drawn table by table (:class:`modules.embedding.row_init.RowInit`), the values the tables would have alone.

Every id is checked against its own table before any lookup (:func:`check_ids`), once per batch and
vectorised: by the model on the CPU, whose FBGEMM kernels then run without their own check
(:func:`modules.sharding.planner.shard_model`), and for a GPU by the loader, on the host batch, in its own thread
(:mod:`pipeline.data.batches`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torchrec import KeyedJaggedTensor


class IdOutOfRangeError(ValueError):
    """An id outside the rows of the table its feature reads; the message names the feature."""

    hint = "the ids must come from the store (or vocabularies) the model was built for"


def check_ids(features: KeyedJaggedTensor, rows: torch.Tensor) -> None:
    """Raise :class:`IdOutOfRangeError` unless every id is a row of its key's table:

        0 ≤ min_k  and  max_k < n_k   for each key k, over its ids;  ``rows`` [K] = (n_k)

    The minimum and maximum of each key's ids: one [K, B] reduction when every key has as many ids
    (one id per bag: the batch builder's layout), else one per key. FBGEMM's own CPU check
    (``bounds_check_indices``, on by default in TorchRec) is a serial loop over the ids of both the
    embedding and the first-order lookups, 1.8 ms of DeepFM's step at batch 8,192 on 2 cores against
    0.08 ms here for 8,192 × 26 ids, so it is switched off on the CPU (docs/throughput.md). It also clamps a bad id to row
    0 with a warning, where this refuses the batch and names the first bad id."""
    keys, values = features.keys(), features.values()
    if values.numel() == 0:
        return
    per_key = features.length_per_key()  # known without a pass when the batch builder set it
    if len(set(per_key)) == 1:
        lo, hi = torch.aminmax(values.view(len(keys), -1), dim=1)
    else:
        ranges = [torch.aminmax(v) if v.numel() else (values.new_zeros(()), values.new_zeros(()) - 1)
                  for v in values.split(per_key)]
        lo, hi = torch.stack([r[0] for r in ranges]), torch.stack([r[1] for r in ranges])
    bad_keys = ((lo < 0) | (hi >= rows.to(hi.device))).nonzero()
    if len(bad_keys):
        k = int(bad_keys[0, 0])
        ids = values.split(per_key)[k]
        bad = ids[(ids < 0) | (ids >= int(rows[k]))][0]
        raise IdOutOfRangeError(f"feature {keys[k]!r}: id {int(bad)} is outside its table's rows [0, {int(rows[k])})")


def shifted_keys(features: KeyedJaggedTensor, offsets: torch.Tensor, dtype: torch.dtype | None,
                 shift_own: bool, added_keys: Sequence[str] = ()) -> KeyedJaggedTensor:
    """``features`` with each key's ids shifted by its ``offsets`` [K] when ``shift_own``, then one more
    key per key (``added_keys``, may be empty) with the same bags and the shifted ids. ``dtype``: the ids'
    type (None: as they are; int64 when the shifted rows pass 2³¹)."""
    keys = features.keys()
    values, lengths = features.values(), features.lengths()
    per_key = lengths.view(len(keys), -1).sum(dim=1)  # on the device: no host round trip
    shift = torch.repeat_interleave(offsets.to(values.device), per_key, output_size=values.numel())
    ids = values.to(dtype or values.dtype)
    shifted = ids + shift
    own = shifted if shift_own else ids
    known = features.length_per_key_or_none()  # passed on when cached: TorchRec's input split sizes
    if not added_keys:
        return KeyedJaggedTensor(keys=keys, values=own, lengths=lengths, stride=features.stride(),
                                 length_per_key=known)
    if len(added_keys) != len(keys):
        raise ValueError(f"{len(added_keys)} added keys for {len(keys)} keys")
    return KeyedJaggedTensor(keys=keys + list(added_keys), values=torch.cat([own, shifted]),
                             lengths=torch.cat([lengths, lengths]), stride=features.stride(),
                             length_per_key=None if known is None else known * 2)


def pool_bags(rows: torch.Tensor, lengths: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Pool ``rows`` [N, D] into bags of ``lengths`` [K·B] (key-major): the sum, divided by the length for
    the keys where ``mean`` [K] is set. Returns [K·B, D]; an empty bag pools to 0."""
    bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths,
                                   output_size=rows.shape[0])
    pooled = torch.zeros(lengths.numel(), rows.shape[1], dtype=rows.dtype, device=rows.device).index_add_(0, bags, rows)
    if bool(mean.any()):
        per_key = lengths.view(mean.numel(), -1)
        divisor = torch.where(mean[:, None], per_key.clamp_min(1), torch.ones_like(per_key)).reshape(-1, 1)
        pooled = pooled / divisor.to(rows.dtype)
    return pooled
