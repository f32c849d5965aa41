"""A checkpoint's tensors whole, in one process, whatever number of processes wrote it (DCP reads every
shard of a table into the whole table) — for export, init-from and scoring a checkpoint."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from modules.embedding.sparse_arch import is_table_parameter
from modules.embedding.ssd_tier.files import mapped_file
from pipeline.checkpoint.safe_reader import SafeFileSystemReader
from pipeline.checkpoint.skeleton import STATE_FILE, placeholders


FLOAT_ROWS = ("float32", "float16", "bfloat16")


def full_model_state(path: str | os.PathLike, prefix: str = "state_dict/model.", table_dir: Path | None = None,
                     keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint as full tensors, in this process, whatever number of
    processes wrote it (DCP reads every shard of a table into the whole table). Keys without ``prefix``;
    ``keep``: only the keys (without ``prefix``) it accepts. With ``table_dir``, embedding tables are read into
    files there (:func:`modules.embedding.ssd_tier.files.mapped_file`): DCP reads them chunk by chunk, so no
    table is whole in memory."""
    path = Path(path)
    # every rank's tensors (rank 0's where ranks share a key): state one rank alone holds is in its file only
    # (model.zch's mapping is split over the ranks)
    found: dict[str, dict[str, Any]] = {}
    rank = 0
    while (path / STATE_FILE.format(rank=rank)).is_file():
        for p in placeholders(json.loads((path / STATE_FILE.format(rank=rank)).read_text())):
            found.setdefault(p["__tensor__"], p)
        rank += 1

    def target(key: str, shape: list[int], dtype: str) -> torch.Tensor:
        # half-precision rows (model.table_precision) read into float32 files: exactly their values
        if table_dir is not None and is_table_parameter(key) and len(shape) == 2 and dtype in FLOAT_ROWS:
            return mapped_file(table_dir / f"{key[len(prefix):]}.f32", shape[0] * shape[1]).view(*shape)
        return torch.empty(shape, dtype=getattr(torch, dtype))

    tensors = {k: target(k, p["shape"], p["dtype"]) for k, p in found.items()
               if k.startswith(prefix) and (keep is None or keep(k[len(prefix):]))}
    with warnings.catch_warnings():  # DCP says it reads without a process group: that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=SafeFileSystemReader(str(path)))
    out = {k[len(prefix):]: v for k, v in tensors.items()}
    return without_doubled_prefix(out) if prefix.startswith("state_dict/") else out


def without_doubled_prefix(state: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """The model's keys as ``DistributedModelParallel.load_state_dict`` takes them. TorchRec's DMP
    ``state_dict(prefix)`` adds the prefix twice when the dense part is not in DDP (one process, k-step
    merging): "model.<key>" there where DDP runs give "<key>" (the task's own "model." removed)."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state

