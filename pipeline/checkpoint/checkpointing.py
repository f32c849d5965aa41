"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), atomic and pickle-free on load.

A Lightning checkpoint dict is split into tensors and the rest:

* tensors — the model state (sharded embedding tables as ``ShardedTensor``, dense weights), the
  fused embedding-optimizer state, each rank's dense-optimizer state, RNG state — go through DCP,
  every rank writing its shards in parallel. Rank-local entries (everything but the model and fused
  optimizer state) are stored under ``rank<r>/`` so each rank gets its own back;
* everything else (loop progress, counters, config, MLflow run id) goes to one JSON file per rank,
  with placeholders ``{"__tensor__": key, "shape": ..., "dtype": ...}`` where tensors were.

What the model's state dict does not hold — the fused optimizer state, the data position, RNG
states, the MLflow run id, the non-finite step count and the *layout* the checkpoint fits (model
config, table shapes, world size) — is added and restored by the callback :class:`TrainingState`;
the layout is compared before any tensor is read (:class:`CheckpointMismatchError` lists every
difference).

Writing goes to ``<name>.tmp-<id>``; once every rank is done, rank 0 writes ``manifest.json`` (every
file's size and SHA-256) and renames the directory to ``<name>``: a checkpoint directory without the
``.tmp-`` suffix is always complete, and :func:`verify_checkpoint` tells whether it is still intact
(``trainer.resume=auto`` skips a damaged newest checkpoint for the one before). Running out of space
while writing removes the partial directory and raises :class:`pipeline.runtime.errors.DiskFullError`. Loading reads tensors with
``weights_only`` and DCP's metadata file through an unpickler that accepts only DCP's own metadata
classes and plain containers — no arbitrary objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import time
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from modules.embedding import is_table_parameter
from modules.file_backed import mapped_file
from pipeline.checkpoint.chunks import MAX_CHUNK_BYTES, row_chunks
from pipeline.runtime.errors import disk_full, ensure_space

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.rank{rank}.json"
MANIFEST = "manifest.json"
GLOBAL_KEYS = ("state_dict", "fused_optimizer")  # sharded or replicated: one copy in the checkpoint
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint._extension", "torch.distributed.checkpoint.planner",
                    "torch.distributed.checkpoint.storage", "torch.distributed._shard.metadata",
                    "torch.distributed._shard.sharded_tensor.metadata", "torch.distributed._shard.sharding_spec")
_ALLOWED_BUILTINS = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                                               "bytes", "bool", "slice", "NoneType", "getattr")}
_ALLOWED_TORCH = {("torch", "Size"), ("torch", "device"), ("torch", "memory_format"), ("torch", "layout"),
                  ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                  ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path")}


class CheckpointMismatchError(ValueError):
    """A checkpoint written for another model, table layout or world size."""


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files no longer match its manifest (truncated, changed or missing)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """``manifest.json``: size and SHA-256 of every other file of a finished checkpoint directory."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify_checkpoint(folder: str | os.PathLike) -> list[str]:
    """What is wrong with a checkpoint directory against its manifest (empty: intact)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return [f"{manifest} is missing"]
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{manifest} is unreadable ({e})"]
    problems = []
    for name, want in entries.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{p} is missing")
        elif p.stat().st_size != want["size"]:
            problems.append(f"{p} has {p.stat().st_size:,} bytes, the manifest says {want['size']:,}")
        elif _sha256(p) != want["sha256"]:
            problems.append(f"{p} does not match its checksum")
    return problems


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _local_bytes(t: Any) -> int:
    """Bytes this rank writes for a tensor: its own shards of a ShardedTensor."""
    if hasattr(t, "local_shards"):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in t.local_shards())
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def split_tensors(obj: Any, prefix: str, tensors: dict[str, Any]) -> Any:
    """Replace tensors (and ShardedTensors) in a nested structure by placeholders; collect them."""
    if torch.is_tensor(obj) or hasattr(obj, "local_shards"):
        tensors[prefix] = obj
        shape = list(obj.size()) if hasattr(obj, "size") else list(obj.shape)
        return {"__tensor__": prefix, "shape": shape, "dtype": str(obj.dtype).removeprefix("torch."),
                "sharded": hasattr(obj, "local_shards")}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{prefix}: checkpoint dict keys must be str or int")
        return {"__dict__": [[k, split_tensors(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{prefix}: cannot store a {type(obj).__name__} in a checkpoint (only tensors, "
                    f"numbers, strings and containers)")


def join_tensors(obj: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: join_tensors(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: join_tensors(v, tensors) for k, v in obj.items()}  # the top level
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj


def _placeholders(obj: Any) -> list[dict]:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return [obj]
        values = [v for _, v in obj["__dict__"]] if "__dict__" in obj else obj.get("__tuple__", list(obj.values()))
        return [p for v in values for p in _placeholders(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in _placeholders(v)]
    return []


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_BUILTINS | _ALLOWED_TORCH or module.startswith(_ALLOWED_MODULES) \
                or (module == "torch" and name.endswith("Storage")) or (module == "torch" and name in dir(torch)
                                                                           and isinstance(getattr(torch, name), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata unpickling admits only DCP metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TrainingState(Callback):
    """Adds to each checkpoint, and restores from it, what a resumed run needs beside the weights.

    ``live_tensors`` and ``layout`` serve :class:`DCPCheckpointIO` (set up with this callback).
    """

    def __init__(self) -> None:
        self.module: L.LightningModule | None = None
        self.trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.trainer, self.module = trainer, pl_module

    def _fused_state(self) -> dict[str, Any]:
        fused = getattr(self.module.model, "fused_optimizer", None)
        return fused.state_dict()["state"] if fused is not None and fused.param_groups else {}

    def live_tensors(self) -> dict[str, Any]:
        """The module's current tensors a checkpoint is loaded into (model and fused-optimizer state)."""
        live: dict[str, Any] = {}
        split_tensors(self.module.state_dict(), "state_dict", live)
        split_tensors(self._fused_state(), "fused_optimizer", live)
        return live

    def layout(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded into this run."""
        plan = self.module.plan
        tables = {name: [p.rows, p.dim] for name, p in sorted(plan.placements.items())} if plan else {}
        return {"model": asdict(self.module.model_cfg), "tables": tables, "world_size": self.trainer.world_size,
                "merging": not self.module.data_parallel}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["fused_optimizer"] = self._fused_state()
        datamodule = trainer.datamodule
        checkpoint["pipeline"] = {
            "layout": self.layout(), "data_position": list(pl_module.data_position),
            # what scoring and export need beside the weights: the declaration and the store's vocabularies
            "run": {"model": asdict(pl_module.model_cfg), "data": asdict(datamodule.data_cfg),
                    "store": str(datamodule.store.root)},
            "skipped_nonfinite": pl_module.nonfinite.skipped,
            "mlflow_run_id": getattr(trainer.logger, "run_id", None) if trainer.logger else None,
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_state(np.random.get_state()),
                    "python": _python_rng_state(random.getstate())},
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["pipeline"]
        fused = getattr(pl_module.model, "fused_optimizer", None)
        if fused is not None and checkpoint.get("fused_optimizer"):
            sd = fused.state_dict()
            sd["state"] = checkpoint["fused_optimizer"]
            fused.load_state_dict(sd)
        trainer.datamodule.resume_position = tuple(state["data_position"])
        pl_module.nonfinite.skipped = state["skipped_nonfinite"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(tuple(state["rng"]["numpy"]))
        random.setstate(_python_rng_from(state["rng"]["python"]))


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
        rank = _rank()
        skeleton = {k: split_tensors(v, k if k in GLOBAL_KEYS else f"rank{rank}/{k}", tensors)
                    for k, v in checkpoint.items()}
        return skeleton, tensors

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        final = Path(path)
        token = [uuid.uuid4().hex[:8] if _rank() == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        tmp = final.with_name(f"{final.name}.tmp-{token[0]}")
        skeleton, tensors = self._split(checkpoint)
        needed = sum(_local_bytes(t) for t in tensors.values())
        ensure_space(final.parent, needed)  # refuse before writing anything
        if _rank() == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        _barrier()
        try:
            t0 = time.perf_counter()
            dcp.save(row_chunks(tensors, self.chunk_bytes), storage_writer=FileSystemWriter(str(tmp)))
            (tmp / STATE_FILE.format(rank=_rank())).write_text(json.dumps(skeleton))
            _barrier()
            if _rank() == 0:
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
        _barrier()

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        state_file = path / STATE_FILE.format(rank=_rank())
        if not state_file.is_file():
            raise CheckpointMismatchError(f"{path} has no state for rank {_rank()}: written by fewer processes?")
        skeleton = json.loads(state_file.read_text())
        differs = _differences(_without_tensors(skeleton)["pipeline"]["layout"], self.state.layout())
        if differs:
            raise CheckpointMismatchError(f"{path}: the checkpoint does not match this run: " + "; ".join(differs))
        live = self.state.live_tensors()
        tensors: dict[str, Any] = {}
        for p in _placeholders(skeleton):
            key = p["__tensor__"]
            if key in live:
                tensors[key] = live[key]
            elif not p.get("sharded"):
                tensors[key] = torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]))
            else:
                raise CheckpointMismatchError(f"{path}: sharded tensor {key} has no counterpart in this model")
        t0 = time.perf_counter()
        dcp.load(row_chunks(tensors, self.chunk_bytes), storage_reader=SafeFileSystemReader(str(path)))
        if _rank() == 0:
            print(f"Checkpoint {path} read in {time.perf_counter() - t0:.2f} s", flush=True)
        return join_tensors(skeleton, tensors)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        shutil.rmtree(path, ignore_errors=True)


def complete_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories in ``folder``, oldest first (by training step, then time)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and ".tmp-" not in p.name and (p / ".metadata").is_file()
             and (p / STATE_FILE.format(rank=0)).is_file()]

    def step(p: Path) -> tuple[int, float]:
        state = json.loads((p / STATE_FILE.format(rank=0)).read_text())
        return int(dict(state["__dict__"]).get("global_step", 0)) if "__dict__" in state else 0, p.stat().st_mtime

    return sorted(found, key=step)


def newest_intact_checkpoint(folder: str | os.PathLike, candidates: list[Path] | None = None) -> Path | None:
    """The newest complete checkpoint in ``folder`` (or of its ``candidates``, already listed) that matches
    its manifest; damaged newer ones are skipped with a warning naming them."""
    for path in reversed(complete_checkpoints(folder) if candidates is None else candidates):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        log.warning("Skipping damaged checkpoint %s: %s", path, "; ".join(problems))
    return None


def checked_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it is an intact checkpoint directory; a folder of checkpoints (a run's
    ``trainer.checkpoint.dir``) means its newest intact one. A damaged one: :class:`CorruptCheckpointError`."""
    path = Path(path)
    if not (path / STATE_FILE.format(rank=0)).is_file():
        candidates = complete_checkpoints(path)
        if candidates:
            newest = newest_intact_checkpoint(path, candidates)
            if newest is None:
                raise CorruptCheckpointError(f"{path}: every checkpoint in this folder is damaged")
            return newest
        raise FileNotFoundError(f"{path} is neither a checkpoint directory (no {STATE_FILE.format(rank=0)}) nor a "
                                f"folder of checkpoints (trainer.checkpoint.dir)")
    problems = verify_checkpoint(path)
    if problems:
        raise CorruptCheckpointError(f"{path} is damaged: " + "; ".join(problems))
    return path


def _without_tensors(skeleton: dict[str, Any]) -> dict[str, Any]:
    """A state file's contents with None where its tensors go."""
    return join_tensors(skeleton, {p["__tensor__"]: None for p in _placeholders(skeleton)})


def read_rank0_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON (non-tensor) part of rank 0's checkpoint state, tensors left as None."""
    return _without_tensors(json.loads((Path(path) / STATE_FILE.format(rank=0)).read_text()))


def full_model_state(path: str | os.PathLike, prefix: str = "state_dict/model.",
                     table_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint as full tensors, in this process, whatever number of
    processes wrote it (DCP reads every shard of a table into the whole table). Keys without ``prefix``.
    With ``table_dir``, embedding tables are read into files there (:func:`modules.file_backed.mapped_file`):
    DCP reads them chunk by chunk, so no table is whole in memory."""
    path = Path(path)
    skeleton = json.loads((path / STATE_FILE.format(rank=0)).read_text())

    def target(key: str, shape: list[int], dtype: str) -> torch.Tensor:
        if table_dir is not None and is_table_parameter(key) and len(shape) == 2 and dtype == "float32":
            return mapped_file(table_dir / f"{key[len(prefix):]}.f32", shape[0] * shape[1]).view(*shape)
        return torch.empty(shape, dtype=getattr(torch, dtype))

    tensors = {p["__tensor__"]: target(p["__tensor__"], p["shape"], p["dtype"])
               for p in _placeholders(skeleton) if p["__tensor__"].startswith(prefix)}
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


def _numpy_rng_state(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]


def _python_rng_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, torch.tensor(internal, dtype=torch.int64), gauss]


def _python_rng_from(state: list) -> tuple:
    version, internal, gauss = state
    return version, tuple(int(x) for x in internal.tolist()), gauss


def _differences(saved: Any, current: Any, path: str = "") -> list[str]:
    """Human-readable differences between two nested layouts."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current), key=str):
            if k not in current:
                out.append(f"{path}{k} only in the checkpoint")
            elif k not in saved:
                out.append(f"{path}{k} only in this run")
            else:
                out += _differences(saved[k], current[k], f"{path}{k}.")
        return out
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        saved, current = list(saved), list(current)
    return [] if saved == current else [f"{path.rstrip('.')}: checkpoint {saved!r}, this run {current!r}"]
