"""The one reader and writer of a model's weights, for training, predict, export, init-from and the
MLflow model alike.

* :func:`write_weights`: a model folder's ``weights.pt`` (every tensor but the embedding tables) and
  ``tables/<name>.f32`` (each table, row-major float32, written in row blocks: :mod:`.table_files`);
* :func:`read_weights`: the full state dict of a model folder (tables memory-mapped, read-only) or of
  a checkpoint (tables read chunk by chunk into files under ``table_dir``, then mapped), so no table
  is ever whole in memory;
* :func:`unsharded_state`: the state dict of a sharded (DMP) model, gathered on rank 0, each table
  written to a file by the ranks holding its shards.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from modules.embedding.sparse_arch import is_table_parameter
from pipeline.checkpoint.full_state import full_model_state
from pipeline.runtime.errors import BundleError
from pipeline.runtime.launch import group_rank
from pipeline.model_folder import table_files
from pipeline.model_folder.quantize import row_bytes, write_quantized
from pipeline.model_folder.source import ModelSource, model_source


def write_weights(folder: Path, state_dict: dict[str, torch.Tensor], tables: dict[str, list[int]],
                  quantize: str = "none") -> None:
    """``tables`` (name → shape) to ``folder/tables/`` (float32, or quantized: :mod:`.quantize`), every other
    tensor to ``folder/weights.pt``."""
    for key in tables:
        if quantize == "none":
            table_files.write(folder / "tables" / f"{key}.f32", state_dict[key])
        else:
            write_quantized(folder / "tables" / f"{key}.u8", state_dict[key], quantize)
    torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k not in tables},
               folder / "weights.pt")


def read_weights(source: ModelSource | str | os.PathLike, table_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of ``source`` (or of the model folder or checkpoint at that path); a checkpoint's
    tables go to files under ``table_dir`` (required)."""
    if not isinstance(source, ModelSource):
        source = model_source(source)
    if source.is_checkpoint:
        if table_dir is None:
            raise ValueError("read_weights of a checkpoint needs a table_dir for its tables")
        return full_model_state(source.path, table_dir=table_dir)
    folder = source.path
    try:
        weights = torch.load(folder / "weights.pt", weights_only=True, map_location="cpu")
        weights.update({k: _mapped_table(folder, k, shape, source.quantize) for k, shape in (source.tables or {}).items()})
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise BundleError(f"{folder}: cannot load the weights ({e})") from None
    return weights


def read_float_weights(source: ModelSource, table_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """:func:`read_weights` with every table as float rows ``rows × dim``, to train from or write again: an fp16
    folder's rows viewed as fp16 (exactly as stored). A folder of int8 / int4 rows is refused: its rows are
    not the model's any more."""
    if not source.is_checkpoint and source.quantize not in ("none", "fp16"):
        raise BundleError(f"{source.path}: its tables are {source.quantize} rows (model.json: quantize), not the "
                          f"trained values; use the run's checkpoint or its float model folder")
    weights = read_weights(source, table_dir)
    if not source.is_checkpoint and source.quantize == "fp16":  # [rows, 2·dim] bytes → [rows, dim] fp16
        weights.update({k: weights[k].view(torch.float16) for k in source.tables or {}})
    return weights


ZCH_FILE = "zch.npz"


def read_zch_state(source: ModelSource) -> dict[str, np.ndarray] | None:
    """The ``model.zch`` mapping of a model folder (``zch.npz``) or checkpoint (:func:`modules.embedding.zch.mapping.mapping_state`);
    None for a model without one."""
    if not source.model_cfg.zch.enabled:
        return None
    if source.is_checkpoint:  # the remapper's state dict, but the ids waiting for a round
        state = full_model_state(source.path, "state_dict/zch.remapper.")
        return {k: v.numpy() for k, v in state.items() if not k.startswith("_extra_state")}
    try:
        with np.load(source.path / ZCH_FILE, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise BundleError(f"{source.path / ZCH_FILE}: cannot read the model.zch mapping ({e})") from None


def _mapped_table(folder: Path, key: str, shape: list[int], quantize: str) -> torch.Tensor:
    """A model folder's table, mapped: float32 ``rows × dim``, or its quantized rows as uint8."""
    if quantize == "none":
        return table_files.mapped(folder / "tables" / f"{key}.f32", shape)
    rows, dim = shape
    return table_files.mapped(folder / "tables" / f"{key}.u8", (rows, row_bytes(dim, quantize)), torch.uint8)


def unsharded_state(module: torch.nn.Module, table_dir: Path) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict of a (DMP-wrapped) model on rank 0, None on other ranks (collective:
    every rank must call it). Embedding tables are written to ``table_dir`` by the ranks holding their
    shards and mapped (:func:`pipeline.model_folder.table_files.unshard_to_file`); other sharded tensors are gathered."""
    rank = group_rank()
    if torch.distributed.is_initialized():  # rank 0's folder: the ranks' output folders may differ
        agreed = [str(table_dir)]
        torch.distributed.broadcast_object_list(agreed, src=0)
        table_dir = Path(agreed[0])
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        if is_table_parameter(key) and len(value.size()) == 2:
            value = table_files.unshard_to_file(value, table_dir / f"{key}.f32")
        elif hasattr(value, "local_shards"):  # gathered where its shards are (NCCL: on the GPU), then to the host
            shards = value.local_shards()
            device = shards[0].tensor.device if shards else torch.device("cpu")
            full = torch.empty(tuple(value.size()), dtype=value.dtype, device=device) if rank == 0 else None
            value.gather(dst=0, out=full)
            value = full
        if rank == 0:
            out[key] = value.detach().cpu()
    return out if rank == 0 else None
