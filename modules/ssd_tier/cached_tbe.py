"""A CPU table batch (TBE) whose tables live in files and are trained through a row cache.

:class:`CachedRowsTBE` is FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` whose host buffers are
the memory-mapped files (:mod:`modules.ssd_tier.files`): TorchRec's state dict, checkpoints, export
and ``init_from`` see the whole tables there. Its forward does not run on them: each of its tables
has a :class:`modules.ssd_tier.row_cache.RowCache`, whose slots are the rows of a second, private TBE of the
same optimizer (``inner``: a table of C_t slots per table). A batch

    indices [N] (rows of the features' tables), offsets [F·B + 1]
      → per table: its features' ids → unique → slots
      → inner(slots[inverse], offsets)                       pooled output, identical layout

so FBGEMM's own kernel pools the rows and, in the backward, updates them (with their optimizer state)
in the slots. Same kernel, same per-row order of gradients: the same numbers as the table in memory.
(One slot table per table: merging the tables of one width into one slot table changes the order in
which FBGEMM's CPU backward sums a row's gradients — measured: 1-ulp differences.)

The files hold every row only after :meth:`CachedRowsTBE.sync_to_file` (dirty rows written back, rows
never met drawn, :meth:`modules.ssd_tier.row_cache.RowCache.materialise`): it runs before anything reads the
tables' state (:func:`sync_tables`: checkpoints, the model folder, the every-row L2's flush). After
anything writes the files from outside (a checkpoint load, ``init_from``), :func:`reload_tables`
drops the slots.

The TBE is made by TorchRec and turned into this class right after (:func:`modules.ssd_tier.files
.file_backed_tables`, the one place that does): TorchRec's sharders build the FBGEMM module
themselves, and a kernel of our own (``CUSTOMIZED_KERNEL``) would have to re-implement the state
dict handling TorchRec gives the fused kernel.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torch import nn

from modules.ssd_tier.row_cache import WAYS, BackingTable, CacheStats, RowCache
from modules.row_init import RowInit
from modules.sharded_kernels import kernels

NOT_INNER = ("embedding_specs", "feature_table_map", "table_names", "preallocated_host_buffers",
             "embedding_shard_info", "res_params")


class CachedRowsTBE(SplitTableBatchedEmbeddingBagsCodegen):
    """A file-backed TBE trained through row caches (module docstring). Made by :meth:`attach`."""

    caches: list[RowCache]
    _inner: list[SplitTableBatchedEmbeddingBagsCodegen]  # in a list: not a submodule (no state dict)

    @classmethod
    def attach(cls, tbe: SplitTableBatchedEmbeddingBagsCodegen, kwargs: dict[str, Any], slots: Sequence[int],
               inits: Sequence[RowInit], policy: str) -> "CachedRowsTBE":
        """Turn a built file-backed ``tbe`` (constructor ``kwargs``) into this class: ``slots`` cache rows per
        table, ``inits`` each table's initialiser."""
        tbe.__class__ = cls
        self: CachedRowsTBE = tbe  # type: ignore[assignment]
        slots = [-(-n // WAYS) * WAYS if n > WAYS else n for n in slots]  # whole sets (a whole table then fits)
        outer = self.split_embedding_weights()
        states = _states(self, len(outer))
        dims = [w.shape[1] for w in outer]
        inner = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(slots, dims)],
            feature_table_map=list(self.feature_table_map), table_names=[f"row_cache{t}" for t in range(len(dims))],
            **{k: v for k, v in kwargs.items() if k not in NOT_INNER})
        inner.learning_rate_tensor = self.learning_rate_tensor  # one rate: TorchRec sets the outer one
        inner_weights, inner_states = inner.split_embedding_weights(), _states(inner, len(dims))
        # (first row, first column, width) of each shard in its whole table
        info = kwargs.get("embedding_shard_info") or [(w.shape[0], d, 0, 0) for w, d in zip(outer, dims)]
        self._inner = [inner]
        self.caches = [RowCache(BackingTable(outer[t], states[t], inits[t], int(row), int(col), int(width)),
                                inner_weights[t], inner_states[t], policy)
                       for t, (_, width, row, col) in enumerate(info)]
        self._features_of = [[f for f, u in enumerate(self.feature_table_map) if u == t] for t in range(len(dims))]
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
        """Each id's slot in its table's cache (module docstring), the missing rows loaded."""
        features = len(self.feature_table_map)
        bounds = offsets[:: (offsets.numel() - 1) // features].tolist() if ids.numel() else [0] * (features + 1)
        out = torch.empty_like(ids)
        for cache, mine in zip(self.caches, self._features_of):
            spans = [(bounds[f], bounds[f + 1]) for f in mine if bounds[f + 1] > bounds[f]]
            if not spans:
                continue
            rows = ids[spans[0][0]:spans[0][1]] if len(spans) == 1 else torch.cat([ids[a:b] for a, b in spans])
            unique, inverse = torch.unique(rows, return_inverse=True)
            slots = cache.assign(unique, dirty)[inverse]
            at = 0
            for a, b in spans:
                out[a:b] = slots[at:at + b - a]
                at += b - a
        return out

    def rows_for_update(self, table: int, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """(slot weights, slot states, the slots of ``rows`` of ``table``): read and write them in place; the
        rows are loaded, pinned for this step and marked dirty."""
        cache = self.caches[table]
        return cache.weights, cache.states, cache.assign(rows, dirty=True)

    def sync_to_file(self) -> None:
        for cache in self.caches:
            cache.materialise()

    def reload(self) -> None:
        for cache in self.caches:
            cache.invalidate()

    def take_stats(self) -> CacheStats:
        total = CacheStats()
        for cache in self.caches:
            total.add(cache.stats.take())
        return total

    @property
    def cache_slots(self) -> int:
        return sum(c.slots for c in self.caches)

    @property
    def cache_bytes(self) -> int:
        return sum(4 * (c.weights.numel() + sum(s.numel() for s in c.states)) for c in self.caches)

    @property
    def row_bytes(self) -> float:
        """Bytes of one row with its optimizer state, as it moves between a cache and the files."""
        rows = sum(c.table.rows for c in self.caches)
        return 4 * (self.weights_host.numel() + getattr(self, "momentum1_host", torch.empty(0)).numel()) / max(1, rows)


def _states(tbe: SplitTableBatchedEmbeddingBagsCodegen, tables: int) -> list[list[torch.Tensor]]:
    """Each table's optimizer-state views (none for SGD)."""
    return [list(s) for s in tbe.split_optimizer_states()] or [[] for _ in range(tables)]


def cached_tbes(model: nn.Module) -> list[CachedRowsTBE]:
    """The row-cached TBEs of a DMP model (TorchRec's lookups are not submodules: found through them)."""
    return [k.emb_module for _, _, k in kernels(model) if isinstance(getattr(k, "emb_module", None), CachedRowsTBE)]


def sync_tables(model: nn.Module) -> None:
    """Before the tables' state is read from their files: every row written there."""
    for tbe in cached_tbes(model):
        tbe.sync_to_file()


def reload_tables(model: nn.Module) -> None:
    """After the tables' files were written from outside: the caches forget their slots."""
    for tbe in cached_tbes(model):
        tbe.reload()
