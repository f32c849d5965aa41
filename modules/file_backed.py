"""The ``ssd`` tier on CPU: embedding tables whose weights and optimizer state live in files.

A table placed on ``ssd`` by a CPU topology (:mod:`modules.placement`) is trained by the same FBGEMM
CPU kernel as a table in host memory (fused SGD / Adagrad / row-wise Adagrad); only its storage
differs. Each table batch (TBE) that holds such tables gets its flat ``weights_host`` and
``momentum1_host`` buffers as shared memory maps of files under ``topology.ssd.path``
(``torch.from_file(shared=True)``: ``mmap(MAP_SHARED)``), handed to FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen(preallocated_host_buffers=...)``. The kernels read and
update rows in place; the operating system's page cache holds the hot rows and writes dirty pages
back to the file, so no cache of our own exists and the table is never whole in anonymous memory:
the file starts sparse (zeros) and TorchRec's uniform initialisation streams into it.

File-backed tables sit in TBEs of their own: their parameter shardings carry a cache precision
(FP32, what the CPU kernels use anyway) that no host table carries, and TorchRec groups tables into
TBEs by their fused parameters.

Files: ``<path>/rank<r>/<table>[+<table>...].<state>.f32`` (state ``weights`` or ``momentum1``),
re-created by each run (a resumed run loads the checkpoint into them).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType, SplitTableBatchedEmbeddingBagsCodegen
from torchrec.distributed.types import CacheParams, DataType, ShardingPlan

MARK = CacheParams(precision=DataType.FP32)
FILE_NAME_MAX = 200
MADV_RANDOM = 1  # <sys/mman.h>


def _libc_madvise():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None


_MADVISE = _libc_madvise()


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
    ``MADV_RANDOM``: a row that misses the page cache reads its page, not a read-ahead window of pages
    around it (rows are looked up at random; measured: 2.9× the samples/s with tables as large as the
    memory limit, docs/scale.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a fresh, sparse file of the right size
        f.truncate(elements * 4)
    table = torch.from_file(str(path), shared=True, size=elements, dtype=torch.float32)
    if elements and _MADVISE is not None:
        _MADVISE(ctypes.c_void_p(table.data_ptr()), ctypes.c_size_t(elements * 4), MADV_RANDOM)
    return table


def _group_file_stem(names: list[str]) -> str:
    stem = "+".join(names)
    if len(stem) > FILE_NAME_MAX:
        stem = f"{names[0]}+{len(names) - 1}more-{hashlib.sha1(stem.encode()).hexdigest()[:12]}"
    return stem


@contextlib.contextmanager
def file_backed_tables(tables: set[str], folder: str | os.PathLike, rank: int) -> Iterator[list[Path]]:
    """While DistributedModelParallel builds the sharded modules: every CPU TBE made only of ``tables``
    gets file-backed host buffers under ``folder/rank<rank>``. Yields the list of files made. The
    constructor is wrapped for the duration of the block only (restored on exit)."""
    made: list[Path] = []
    if not tables:
        yield made
        return
    original = SplitTableBatchedEmbeddingBagsCodegen.__init__

    def init(self: SplitTableBatchedEmbeddingBagsCodegen, *args: Any, **kwargs: Any) -> None:
        names = list(kwargs.get("table_names") or [])
        if names and set(names) <= tables:
            specs = list(kwargs["embedding_specs"] if "embedding_specs" in kwargs else args[0])
            optimizer = kwargs.get("optimizer", OptimType.EXACT_SGD)
            stem = Path(folder) / f"rank{rank}" / _group_file_stem(names)
            buffers = {state: mapped_file(stem.with_name(f"{stem.name}.{state}.f32"), n)
                       for state, n in state_sizes(specs, optimizer).items()}
            made.extend(stem.with_name(f"{stem.name}.{state}.f32") for state in buffers)
            kwargs["preallocated_host_buffers"] = buffers
        elif names and set(names) & tables:
            raise RuntimeError(f"a TBE mixes file-backed and in-memory tables: {names} (ssd: {sorted(tables)})")
        original(self, *args, **kwargs)

    SplitTableBatchedEmbeddingBagsCodegen.__init__ = init  # type: ignore[method-assign]
    try:
        yield made
    finally:
        SplitTableBatchedEmbeddingBagsCodegen.__init__ = original  # type: ignore[method-assign]
