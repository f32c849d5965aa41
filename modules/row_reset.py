"""Rows that start afresh while training: an id evicted by ``model.zch`` leaves its row to another id
(:mod:`modules.zch`), which must not inherit what the old id learned.

For every FBGEMM kernel of the sharded model (:mod:`modules.sharded_kernels`) and every table in it that
holds a logical table with such rows — ``emb_<t>``, or the first-order / stacked tables at the table's
offset (:func:`table_segments`) — the rows of this rank's shard get

* the weights they had at initialisation: the table's ``init_fn`` (:class:`modules.row_init.RowInit`, a
  pure function of (seed, table, row), so the same values wherever the table sits);
* zero optimizer state (Adagrad's sum of squares, Adam's moments: a fresh row's).

Fused (table-wise / row-wise) kernels only: a data-parallel table's optimizer state lives in a torch
optimizer and a row-cached one in its cache; both are refused by the caller before training starts.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from modules.embedding import EMB_PREFIX, STACKED_TABLE, WIDE_SEQ_TABLE, WIDE_TABLE, FeatureSpec, wide_row_offsets
from modules.sharded_kernels import kernels


def table_segments(spec: FeatureSpec, physical: str) -> dict[str, tuple[int, int]]:
    """Table → (first row, rows) inside the physical table ``physical``: ``emb_<t>`` holds table t alone; the
    first-order and stacked tables hold their features' tables at :func:`wide_row_offsets`."""
    if physical in (WIDE_TABLE, WIDE_SEQ_TABLE, STACKED_TABLE):
        features = spec.seq_features if physical == WIDE_SEQ_TABLE else spec.bag_features
        offsets = wide_row_offsets(spec, features)
        return {spec.table_of(f): (offsets[f], spec.table_sizes[spec.table_of(f)]) for f in features}
    t = physical[len(EMB_PREFIX):]
    return {t: (0, spec.table_sizes[t])}


def _local_rows(meta: object) -> tuple[int, int]:
    """(first row, first column) of this rank's shard of a kernel table."""
    if meta is None:
        return 0, 0
    return int(meta.shard_offsets[0]), int(meta.shard_offsets[1])


@torch.no_grad()
def reset_rows(model: nn.Module, spec: FeatureSpec, inits: dict[str, Callable], rows: dict[str, torch.Tensor]
               ) -> Iterator[tuple[nn.Module, int, torch.Tensor]]:
    """Start ``rows`` (logical table → row ids) afresh in every physical table that holds them; ``inits``:
    physical table → its ``init_fn``. Yields (kernel, table index in the kernel, local rows) of every change,
    for per-row bookkeeping of others (the every-row L2's last step)."""
    if not rows:
        return
    for _, _, kernel in kernels(model):
        emb = kernel.emb_module
        weights, states = emb.split_embedding_weights(), emb.split_optimizer_states()
        for i, table in enumerate(kernel.config.embedding_tables):
            segments = table_segments(spec, table.name)
            wanted = [start + rows[t] for t, (start, _) in segments.items() if t in rows]
            if not wanted:
                continue
            physical = torch.cat(wanted)
            first_row, first_col = _local_rows(getattr(table, "local_metadata", None))
            local = physical - first_row
            local = local[(local >= 0) & (local < weights[i].shape[0])]
            if not len(local):
                continue
            full = inits[table.name].rows(local + first_row, table.embedding_dim)
            weights[i][local] = full[:, first_col:first_col + weights[i].shape[1]].to(weights[i].dtype)
            for state in states[i]:
                state[local] = 0
            yield kernel, i, local
