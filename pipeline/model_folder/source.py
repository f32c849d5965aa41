"""A model to use, from a model folder or a checkpoint: the one place that tells them apart.

:func:`model_source` reads the description — model config, dataset declaration, the store's feature
description, the folder holding the vocabularies, the MLflow run — from a model folder's
``model.json`` or a checkpoint's run description (:mod:`pipeline.checkpoint.run_description`); the
weights come from :func:`pipeline.model_folder.weights.read_weights`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.models import ModelConfig
from pipeline.checkpoint.run_description import checkpoint_run, declaration_from
from pipeline.data.dataset import DataConfig
from pipeline.data.store import with_table_sizes
from pipeline.runtime.errors import BundleError


@dataclass
class ModelSource:
    path: Path                  # the model folder, or the checkpoint directory itself
    model_cfg: ModelConfig
    data: DataConfig            # the declaration raw rows are read with
    store_meta: dict[str, Any]  # the store's feature description: tables, sizes, transforms, ranges
    vocab_root: Path            # the folder whose vocab/ holds the tables' vocabularies
    mlflow_run_id: str | None
    tables: dict[str, list[int]] | None  # a model folder's table files and shapes; None: a checkpoint
    quantize: str = "none"               # a model folder's tables: none (float32) | int8 | int4 | fp16

    @property
    def is_checkpoint(self) -> bool:
        return self.tables is None


def is_model_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / "model.json").is_file()


def model_source(path: str | os.PathLike, verify: bool = True) -> ModelSource:
    """The model at ``path``: a model folder, a checkpoint directory or a folder of checkpoints (its newest
    intact one). Raises :class:`BundleError` (or ``FileNotFoundError``) naming what cannot be read.
    A checkpoint's files are hashed against its manifest (seconds per GB): resolve a source once and
    pass the :class:`ModelSource` on; ``verify=False`` reads the description alone."""
    path = Path(path)
    if is_model_folder(path):
        try:
            d = json.loads((path / "model.json").read_text())
            return ModelSource(path, ModelConfig.from_saved(d["model"]), declaration_from(d["data"]), d["store"], path,
                               d.get("mlflow_run_id"), d.get("tables", {}), d.get("quantize", "none"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BundleError(f"{path / 'model.json'}: cannot read the model description ({e})") from None
    run = checkpoint_run(path, verify)
    meta = with_table_sizes(run.store.meta, run.model_cfg.zch)  # a raw store's tables are sized by model.zch
    return ModelSource(run.path, run.model_cfg, run.data, meta, run.store.root, run.mlflow_run_id, None)
