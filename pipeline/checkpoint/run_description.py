"""What a checkpoint records of its run beside the tensors (:class:`.training_state.TrainingState`
writes it): the model config, the dataset declaration and the store it trained on, whose vocabularies
scoring needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from modules.models import ModelConfig
from pipeline.checkpoint.discovery import checked_checkpoint, read_rank0_state
from pipeline.data.dataset import DataConfig
from pipeline.data.store import ColumnarStore
from pipeline.runtime.errors import BundleError


def declaration_from(raw: dict[str, Any]) -> DataConfig:
    """A dataset declaration saved as a plain dict (model.json, a checkpoint) as a typed DataConfig."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), raw))  # type: ignore[return-value]


@dataclass
class CheckpointRun:
    """What a checkpoint records of its run beside the tensors: the model, the dataset and its store."""

    path: Path
    model_cfg: ModelConfig
    data: DataConfig
    store: ColumnarStore
    mlflow_run_id: str | None


def checkpoint_run(checkpoint: str | os.PathLike, verify: bool = True) -> CheckpointRun:
    """The checkpoint's run description (checked against its manifest first); the store it trained on
    must be on this machine (its vocabularies)."""
    path = checked_checkpoint(checkpoint, verify)
    state = read_rank0_state(path)["pipeline"]
    run = state.get("run")
    if run is None:
        raise BundleError(f"{path}: the checkpoint does not describe its model and data (written by an older "
                          f"version); use the model folder of a newer run instead")
    try:
        store = ColumnarStore(run["store"])
    except (FileNotFoundError, ValueError) as e:
        raise BundleError(f"{path}: the store the run trained on is needed for its vocabularies: {e}") from None
    return CheckpointRun(path, ModelConfig.from_saved(run["model"]), declaration_from(run["data"]), store,
                         state.get("mlflow_run_id"))
