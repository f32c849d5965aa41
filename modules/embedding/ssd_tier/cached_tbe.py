"""A CPU table batch (TBE) whose tables live in files and are trained through a row cache.

:class:`CachedRowsTBE` is FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` whose host buffers are
the memory-mapped files (:mod:`modules.embedding.ssd_tier.files`): TorchRec's state dict, checkpoints, export
and ``init_from`` see the whole tables there. Its forward does not run on them: its tables have a
:class:`modules.embedding.ssd_tier.row_cache.RowCache`, whose slots are the rows of a second, private TBE of the
same optimizer (``inner``: a slot table of C_t rows per table). A batch

    indices [N] (rows of the features' tables), offsets [F·B + 1]
      → linear ids (first row of the feature's table + row) → unique → slots → rows of the slot tables
      → inner(slots[inverse], offsets)                       pooled output, identical layout

so FBGEMM's own kernel pools the rows and, in the backward, updates them (with their optimizer state)
in the slots. Same kernel, same per-row order of gradients: the same numbers as the table in memory.
(One slot table per table: merging the tables of one width into one slot table changes the order in
which FBGEMM's CPU backward sums a row's gradients — measured: 1-ulp differences.)

The files hold every row only after :meth:`CachedRowsTBE.sync_to_file` (dirty rows written back, rows
never met drawn, :meth:`modules.embedding.ssd_tier.row_cache.RowCache.materialise`): it runs before anything reads the
tables' state (:func:`modules.embedding.table_views.sync_tables`: checkpoints, the model folder, the every-row L2's
flush). After
anything writes the files from outside (a checkpoint load, ``init_from``), ``reload_tables`` there
drops the slots.

The TBE is made by TorchRec and turned into this class right after (:func:`modules.embedding.ssd_tier.files
.file_backed_tables`, the one place that does): TorchRec's sharders build the FBGEMM module
themselves, and a kernel of our own (``CUSTOMIZED_KERNEL``) would have to re-implement the state
dict handling TorchRec gives the fused kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec import KeyedJaggedTensor

from modules.embedding.ssd_tier.backing import BackingTable, CacheStats
from modules.embedding.ssd_tier.row_cache import WAYS, RowCache
from modules.embedding.ssd_tier.rows_ahead import RowsAhead
from modules.embedding.row_init import RowInit
from modules.embedding.sharded_kernels import kernels

NOT_INNER = ("embedding_specs", "feature_table_map", "table_names", "preallocated_host_buffers",
             "embedding_shard_info", "res_params")


class CachedRowsTBE(SplitTableBatchedEmbeddingBagsCodegen):
    """A file-backed TBE trained through row caches (module docstring). Made by :meth:`attach`."""

    cache: RowCache
    ahead: RowsAhead  # the next batch's rows brought in while a step computes
    _inner: list[SplitTableBatchedEmbeddingBagsCodegen]  # in a list: not a submodule (no state dict)

    @classmethod
    def attach(cls, tbe: SplitTableBatchedEmbeddingBagsCodegen, kwargs: dict[str, Any], slots: Sequence[int],
               inits: Sequence[RowInit], policy: str, runs: Path | None = None) -> "CachedRowsTBE":
        """Turn a built file-backed ``tbe`` (constructor ``kwargs``) into this class: ``slots`` cache rows per
        table (rounded up to whole sets), ``inits`` each table's initialiser, ``runs`` the stem of the sorted
        runs' files (:mod:`modules.embedding.ssd_tier.sorted_runs`; none: evicted rows go home at once)."""
        tbe.__class__ = cls
        self: CachedRowsTBE = tbe  # type: ignore[assignment]
        slots = [max(WAYS, -(-n // WAYS) * WAYS) for n in slots]
        outer = self.split_embedding_weights()
        dims = [w.shape[1] for w in outer]
        inner = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(slots, dims)],
            feature_table_map=list(self.feature_table_map), table_names=[f"row_cache{t}" for t in range(len(dims))],
            **{k: v for k, v in kwargs.items() if k not in NOT_INNER})
        inner.learning_rate_tensor = self.learning_rate_tensor  # one rate: TorchRec sets the outer one
        # (first row, first column, width) of each shard in its whole table
        info = kwargs.get("embedding_shard_info") or [(w.shape[0], d, 0, 0) for w, d in zip(outer, dims)]
        states = _states(self, len(dims))
        backing = [BackingTable(outer[t], states[t], inits[t], int(row), int(col), int(width))
                   for t, (_, width, row, col) in enumerate(info)]
        self._inner = [inner]
        # the slots as `.data` views: rows brought in by the look-ahead thread while FBGEMM's autograd holds the
        # slot tables for a backward are other rows than the batch's (pinned), not a change autograd must see
        self.cache = RowCache(backing, [w.data for w in inner.split_embedding_weights()],
                              [[s.data for s in st] for st in _states(inner, len(dims))], policy, runs)
        self.ahead = RowsAhead(self.cache)
        self._first_of_feature = torch.tensor([int(self.cache.first[t]) for t in self.feature_table_map], device="cpu")
        return self

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                feature_requires_grad: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or any(v is not None for v in kwargs.values()):
            raise NotImplementedError(f"the row-cached ssd tier takes indices, offsets and per-sample weights only "
                                      f"(got {sorted(k for k, v in kwargs.items() if v is not None)})")
        offsets = offsets.long()
        slots = self.remap(indices.long(), offsets, dirty=torch.is_grad_enabled())
        inner = self._inner[0]
        inner.optimizer_args = self.optimizer_args  # hyper-parameters TorchRec may have updated
        return inner(slots, offsets, per_sample_weights, feature_requires_grad)

    def remap(self, ids: torch.Tensor, offsets: torch.Tensor, dirty: bool) -> torch.Tensor:
        """Each id's slot in its table's slot table (module docstring), the missing rows loaded."""
        if not ids.numel():
            return ids
        features = self._first_of_feature.numel()
        bounds = offsets[:: (offsets.numel() - 1) // features]
        lin = ids + torch.repeat_interleave(self._first_of_feature, bounds[1:] - bounds[:-1], output_size=ids.numel())
        slots, table, inverse = self.ahead.batch(lin, dirty)  # of the unique ids, and each id's place among them
        return self.cache.local_slots(slots, table)[inverse]

    def bring_ahead(self, ids: Sequence[torch.Tensor]) -> None:
        """Start bringing in the rows of the next training batch, ``ids`` of each feature in the module's
        feature order (:mod:`.rows_ahead`)."""
        lin = torch.cat([f.long() + int(first) for f, first in zip(ids, self._first_of_feature)])
        if lin.numel():
            self.ahead.start(lin)

    def rows_for_update(self, table: int, rows: torch.Tensor, overwrite: bool = False
                        ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """(slot weights, slot states, the slots of ``rows`` of ``table``): read and write them in place; the
        rows are loaded, pinned for this step and marked dirty. ``overwrite``: the caller writes every row
        whole (weights and state): rows not cached are not read first."""
        slots, tables = self.ahead.beside(rows + int(self.cache.first[table]), dirty=True, load=not overwrite)
        return self.cache.weights[table], self.cache.states[table], self.cache.local_slots(slots, tables)

    def sync_to_file(self) -> None:
        self.ahead.wait()  # the rows it brought stay in their slots (written back, not moved): its result holds
        self.cache.materialise()

    def reload(self) -> None:
        self.ahead.drop()
        self.cache.invalidate()

    def take_stats(self) -> CacheStats:
        self.ahead.wait()
        return self.cache.stats.take()

    @property
    def cache_slots(self) -> int:
        return self.cache.slots

    @property
    def cache_bytes(self) -> int:
        return 4 * sum(w.numel() + sum(s.numel() for s in st) for w, st in zip(self.cache.weights, self.cache.states))

    @property
    def row_bytes(self) -> float:
        """Bytes of one row with its optimizer state, as it moves between a cache and the files."""
        rows = sum(t.rows for t in self.cache.tables)
        state = getattr(self, "momentum1_host", torch.empty(0, device="cpu"))
        return 4 * (self.weights_host.numel() + state.numel()) / max(1, rows)


def _states(tbe: SplitTableBatchedEmbeddingBagsCodegen, tables: int) -> list[list[torch.Tensor]]:
    """Each table's optimizer-state views (none for SGD)."""
    return [list(s) for s in tbe.split_optimizer_states()] or [[] for _ in range(tables)]


def cached_tbes(model: nn.Module) -> list[CachedRowsTBE]:
    """The row-cached TBEs of a DMP model (TorchRec's lookups are not submodules: found through them)."""
    return [k.emb_module for _, _, k in kernels(model) if isinstance(getattr(k, "emb_module", None), CachedRowsTBE)]


def bring_ahead(collection: nn.Module, features: KeyedJaggedTensor) -> None:
    """Start bringing the next training batch's rows into the row caches of a sharded ``collection``'s kernels:
    ``features`` the KJT the collection will be called with. One process: a kernel receives its features'
    ids as the batch holds them (with several ranks, other ranks' ids after the input all-to-all: not known
    ahead). Whether it guessed right is checked at the next forward (:mod:`.rows_ahead`)."""
    values = None
    for _, _, kernel in kernels(collection):
        emb = getattr(kernel, "emb_module", None)
        if isinstance(emb, CachedRowsTBE):
            values = values if values is not None else features.to_dict()
            names = [f for table in kernel.config.embedding_tables for f in table.feature_names]  # the TBE's order
            emb.bring_ahead([values[f].values() for f in names])
