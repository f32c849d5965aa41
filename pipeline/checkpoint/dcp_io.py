"""Lightning's ``CheckpointIO`` over DCP: every rank writes its shards in parallel, atomically.

Writing goes to ``<name>.tmp-<id>``; once every rank is done, rank 0 writes the manifest
(:mod:`.manifest`) and renames the directory to ``<name>``: a checkpoint directory without the
``.tmp-`` suffix is always complete. Running out of space while writing removes the partial directory
and raises :class:`pipeline.runtime.errors.DiskFullError`. Reading checks the layout first
(:class:`CheckpointMismatchError` lists every difference), then fills the module's tensors in place,
row chunk by row chunk (:mod:`.chunks`), with ``weights_only`` and the safe metadata reader.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from pipeline.checkpoint.chunks import MAX_CHUNK_BYTES, row_chunks
from pipeline.checkpoint.manifest import write_manifest
from pipeline.checkpoint.safe_reader import SafeFileSystemReader
from pipeline.checkpoint.skeleton import (
    STATE_FILE,
    join_tensors,
    placeholders,
    split_tensors,
    stored_once,
    without_tensors,
)
from pipeline.checkpoint.training_state import TrainingState, differences
from pipeline.runtime.errors import CheckpointMismatchError, disk_full, ensure_space
from pipeline.runtime.launch import barrier, group_rank


def _local_bytes(t: Any) -> int:
    """Bytes this rank writes for a tensor: its own shards of a ShardedTensor."""
    if hasattr(t, "local_shards"):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in t.local_shards())
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0



class DCPCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing/reading DCP checkpoint directories (called on every rank).

    ``state`` gives the module's current sharded tensors (model + fused optimizer state), which DCP
    fills in place on load, and the layout a checkpoint must match.
    """

    def __init__(self, state: TrainingState, chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self.state = state
        self.chunk_bytes = chunk_bytes

    @staticmethod
    def _split(checkpoint: dict[str, Any]) -> tuple[dict, dict[str, Any]]:
        tensors: dict[str, Any] = {}
        rank = group_rank()
        skeleton = {k: split_tensors(v, k if stored_once(k) else f"rank{rank}/{k}", tensors)
                    for k, v in checkpoint.items()}
        return skeleton, tensors

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        final = Path(path)
        token = [uuid.uuid4().hex[:8] if group_rank() == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        tmp = final.with_name(f"{final.name}.tmp-{token[0]}")
        skeleton, tensors = self._split(checkpoint)
        needed = sum(_local_bytes(t) for t in tensors.values())
        ensure_space(final.parent, needed)  # refuse before writing anything
        if group_rank() == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        try:
            t0 = time.perf_counter()
            # a tensor several ranks hold (the dense part, a copy of the tables) from the lowest of them: between
            # k-step merges rank 0's replica, the others' in their own state (pipeline/training/callbacks/kstep_merging.py)
            dcp.save(row_chunks(tensors, self.chunk_bytes), storage_writer=FileSystemWriter(str(tmp)),
                     planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
            (tmp / STATE_FILE.format(rank=group_rank())).write_text(json.dumps(skeleton))
            barrier()
            if group_rank() == 0:
                write_manifest(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)
                print(f"Checkpoint {final} written in {time.perf_counter() - t0:.2f} s ({needed / 1e6:,.1f} MB on rank 0)",
                      flush=True)
        except BaseException as e:  # DCP reports write failures in its own exception types
            shutil.rmtree(tmp, ignore_errors=True)
            full = disk_full(e, tmp, needed)
            if full is not None:
                raise full from e
            raise
        barrier()

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        state_file = path / STATE_FILE.format(rank=group_rank())
        if not state_file.is_file():
            raise CheckpointMismatchError(f"{path} has no state for rank {group_rank()}: written by fewer processes?")
        skeleton = json.loads(state_file.read_text())
        differs = differences(without_tensors(skeleton)["pipeline"]["layout"], self.state.layout())
        if differs:
            raise CheckpointMismatchError(f"{path}: the checkpoint does not match this run: " + "; ".join(differs))
        live = self.state.live_tensors()
        tensors: dict[str, Any] = {}
        for p in placeholders(skeleton):
            key = p["__tensor__"]
            if key in live and (p.get("sharded") or list(live[key].shape) == list(p["shape"])):
                tensors[key] = live[key]  # read in place (tables: views of the live ones)
            elif not p.get("sharded"):  # also state whose size varies (model.zch's ids waiting for admission)
                tensors[key] = torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]))
            else:
                raise CheckpointMismatchError(f"{path}: sharded tensor {key} has no counterpart in this model")
        t0 = time.perf_counter()
        dcp.load(row_chunks(tensors, self.chunk_bytes), storage_reader=SafeFileSystemReader(str(path)))
        if group_rank() == 0:
            print(f"Checkpoint {path} read in {time.perf_counter() - t0:.2f} s", flush=True)
        return join_tensors(skeleton, tensors)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        shutil.rmtree(path, ignore_errors=True)

