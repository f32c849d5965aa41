"""Rows that start afresh while training: an id evicted by ``model.zch`` leaves its row to another id
(:mod:`modules.embedding.zch.remapper`), which must not inherit what the old id learned.

For every FBGEMM kernel of the sharded model (:mod:`modules.embedding.sharded_kernels`) and every table in it that
holds a logical table with such rows — ``emb_<t>``, or the first-order / stacked tables at the table's
offset (:func:`table_segments`) — the rows of this rank's shard get

* the weights they had at initialisation: the table's ``init_fn`` (:class:`modules.embedding.row_init.RowInit`, a
  pure function of (seed, table, row), so the same values wherever the table sits);
* zero optimizer state (Adagrad's sum of squares, Adam's moments: a fresh row's).

A table on the ``ssd`` tier is reset through its row cache (:meth:`CachedRowsTBE.rows_for_update`, in chunks
the cache holds at once): the rows get slots without being read from the files (they are overwritten whole),
are overwritten and marked dirty, so the files see them when the cache writes them back. Fused kernels only: a
data-parallel table's optimizer state lives in a torch optimizer (refused by the caller before training starts).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from modules.embedding.sparse_arch import EMB_PREFIX, STACKED_TABLE, WIDE_SEQ_TABLE, WIDE_TABLE, FeatureSpec, wide_row_offsets
from modules.embedding.sharded_kernels import kernels
from modules.embedding.ssd_tier.cached_tbe import CachedRowsTBE


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
            if isinstance(emb, CachedRowsTBE):
                for part in local.split(max(1, emb.cache.slots // (4 * len(weights)))):
                    w, st, at = emb.rows_for_update(i, part, overwrite=True)
                    _fresh(w, st, at, inits[table.name], part + first_row, table.embedding_dim, first_col)
            else:
                _fresh(weights[i], states[i], local, inits[table.name], local + first_row, table.embedding_dim,
                       first_col)
            yield kernel, i, local


def _fresh(weights: torch.Tensor, states: list[torch.Tensor], at: torch.Tensor, init: Callable, rows: torch.Tensor,
           dim: int, first_col: int) -> None:
    """Rows ``at`` of a table's (shard's) ``weights`` as initialised — physical ``rows`` of the ``dim``-wide table,
    from column ``first_col`` — and their optimizer ``states`` zero."""
    full = init.rows(rows, dim)
    weights[at] = full[:, first_col:first_col + weights.shape[1]].to(weights.dtype)
    for state in states:
        state[at] = 0
