"""The ``ssd`` tier on CPU: embedding tables whose weights and optimizer state live in files.

A table placed on ``ssd`` by a CPU topology (:mod:`modules.sharding.placement`) is trained by the same FBGEMM
CPU kernel as a table in host memory (fused SGD / Adagrad / row-wise Adagrad); only its storage
differs. Each table batch (TBE) that holds such tables gets its flat ``weights_host`` and
``momentum1_host`` buffers as shared memory maps of files under ``topology.ssd.path``
(``torch.from_file(shared=True)``: ``mmap(MAP_SHARED)``), handed to FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen(preallocated_host_buffers=...)``, and is then turned into a
:class:`modules.embedding.ssd_tier.cached_tbe.CachedRowsTBE`: the kernel runs on a row cache in host memory
(:mod:`modules.embedding.ssd_tier.row_cache`) sized by the placement, and the files are its backing store. The files
start sparse (zeros) and are not written at initialisation: a row is drawn from (seed, table, row)
when the cache first meets it (:mod:`modules.embedding.row_init`), so the table is never whole in memory.

File-backed tables sit in TBEs of their own: their parameter shardings carry a cache precision
(FP32, what the CPU kernels use anyway) that no host table carries, and TorchRec groups tables into
TBEs by their fused parameters.

Files: ``<path>/rank<r>/<table>[+<table>...].<state>.f32`` (state ``weights`` or ``momentum1``) and the
row cache's sorted runs ``<table>[+<table>...].run<n>.{keys,records}`` (:mod:`.sorted_runs`), made by each
run and deleted when it ends (a resumed run loads the checkpoint into new table files). A rank's folder is
locked by one run at a time (:mod:`.path_lock`): a second run there is refused, naming the first.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType, SplitTableBatchedEmbeddingBagsCodegen
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BaseBatchedEmbeddingBag
from torchrec.distributed.types import CacheParams, DataType, ShardingPlan

from modules.embedding.ssd_tier.cached_tbe import CachedRowsTBE
from modules.embedding.ssd_tier.paged_records import MADV_RANDOM, MADVISE
from modules.embedding.ssd_tier.path_lock import lock_rank_folder
from modules.embedding.row_init import RowInit

MARK = CacheParams(precision=DataType.FP32)
FILE_NAME_MAX = 200


def mark_file_backed(plan: ShardingPlan, tables: set[str]) -> None:
    """Give the shardings of ``tables`` the cache precision that keeps them in TBEs of their own."""
    for module_plan in plan.plan.values():
        for name, sharding in module_plan.items():  # type: ignore[union-attr]
            if name in tables:
                sharding.cache_params = MARK


def state_sizes(specs: list[tuple[int, int, Any, Any]], optimizer: OptimType) -> dict[str, int]:
    """Elements of each flat host buffer of a CPU TBE with ``specs`` (rows, dim, ...): weights
    Σ rows·dim; Adagrad's accumulator Σ rows·dim; row-wise Adagrad's Σ rows; SGD none."""
    sizes = {"weights": sum(rows * dim for rows, dim, *_ in specs)}
    if optimizer == OptimType.EXACT_ADAGRAD:
        sizes["momentum1"] = sizes["weights"]
    elif optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
        sizes["momentum1"] = sum(rows for rows, *_ in specs)
    elif optimizer != OptimType.EXACT_SGD:
        raise ValueError(f"tier=ssd on CPU: the fused optimizer {optimizer} has no file-backed state here; "
                         f"use sgd, adagrad or rowwise_adagrad")
    return sizes


def mapped_file(path: Path, elements: int) -> torch.Tensor:
    """A float32 tensor of ``elements`` zeros backed by ``path`` (created sparse; shared mapping), advised
    ``MADV_RANDOM``: a row the row cache reads back reads its page, not a read-ahead window of pages
    around it (rows are read at random; measured before the row cache, when the kernel read the maps
    directly: 2.9× the samples/s with tables as large as the memory limit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a fresh, sparse file of the right size
        f.truncate(elements * 4)
    table = torch.from_file(str(path), shared=True, size=elements, dtype=torch.float32)
    if elements and MADVISE is not None:
        MADVISE(ctypes.c_void_p(table.data_ptr()), ctypes.c_size_t(elements * 4), MADV_RANDOM)
    return table


def _group_file_stem(names: list[str]) -> str:
    stem = "+".join(names)
    if len(stem) > FILE_NAME_MAX:
        stem = f"{names[0]}+{len(names) - 1}more-{hashlib.sha1(stem.encode()).hexdigest()[:12]}"
    return stem


@dataclass(frozen=True)
class CachedTable:
    """What the seam needs of a file-backed table: its row-cache size (rows) and its initialiser."""

    slots: int
    init: RowInit


def unavailable() -> str | None:
    """Why this FBGEMM cannot back tables with files (None: it can): its TBE must take ``preallocated_host_buffers``
    (fbgemm-gpu 1.9; 1.6.0, the torch 2.11 stack's, has no such argument)."""
    if "preallocated_host_buffers" in inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters:
        return None
    try:
        version = importlib.metadata.version("fbgemm-gpu-cpu")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("fbgemm-gpu")
    return f"FBGEMM {version} cannot give its tables host buffers of our own (preallocated_host_buffers: fbgemm-gpu 1.9+)"


@contextlib.contextmanager
def file_backed_tables(tables: Mapping[str, CachedTable], folder: str | os.PathLike, rank: int,
                       policy: str = "lfu") -> Iterator[list[Path]]:
    """While DistributedModelParallel builds the sharded modules: every CPU TBE made only of ``tables``
    gets file-backed host buffers under ``folder/rank<rank>`` and becomes a row-cached TBE, which TorchRec's
    kernels do not fill with their uniform initialisation (the rows are drawn when first met). Yields the
    list of files made. FBGEMM's constructor and TorchRec's ``init_parameters`` are wrapped for the
    duration of the block only (restored on exit)."""
    made: list[Path] = []
    if not tables:
        yield made
        return
    original = SplitTableBatchedEmbeddingBagsCodegen.__init__

    def init(self: SplitTableBatchedEmbeddingBagsCodegen, *args: Any, **kwargs: Any) -> None:
        names = list(kwargs.get("table_names") or [])
        if names and set(names) <= set(tables):
            if args:
                raise RuntimeError("file-backed tables: TorchRec built its FBGEMM module with positional arguments")
            specs = list(kwargs["embedding_specs"])
            optimizer = kwargs.get("optimizer", OptimType.EXACT_SGD)
            # the lock before any file (taking it deletes a killed run's files)
            stem = lock_rank_folder(Path(folder) / f"rank{rank}") / _group_file_stem(names)
            buffers = {state: mapped_file(stem.with_name(f"{stem.name}.{state}.f32"), n)
                       for state, n in state_sizes(specs, optimizer).items()}
            made.extend(stem.with_name(f"{stem.name}.{state}.f32") for state in buffers)
            kwargs["preallocated_host_buffers"] = buffers
            original(self, *args, **kwargs)
            slots = [min(tables[n].slots, rows) for n, (rows, *_) in zip(names, specs)]
            CachedRowsTBE.attach(self, kwargs, slots, [tables[n].init for n in names], policy, stem)
            return
        if names and set(names) & set(tables):
            raise RuntimeError(f"a TBE mixes file-backed and in-memory tables: {names} (ssd: {sorted(tables)})")
        original(self, *args, **kwargs)

    kernels = (BaseBatchedEmbedding, BaseBatchedEmbeddingBag)
    initialisers = [k.init_parameters for k in kernels]

    def skip_cached(initialise: Any):
        def init_parameters(kernel: Any) -> None:  # TorchRec's uniform fill would write every row of the files
            if not isinstance(getattr(kernel, "_emb_module", None), CachedRowsTBE):
                initialise(kernel)
        return init_parameters

    SplitTableBatchedEmbeddingBagsCodegen.__init__ = init  # type: ignore[method-assign]
    for k, initialise in zip(kernels, initialisers):
        k.init_parameters = skip_cached(initialise)  # type: ignore[method-assign]
    try:
        yield made
    finally:
        SplitTableBatchedEmbeddingBagsCodegen.__init__ = original  # type: ignore[method-assign]
        for k, initialise in zip(kernels, initialisers):
            k.init_parameters = initialise  # type: ignore[method-assign]
