"""A trained model as one self-contained folder: everything scoring raw rows needs, no training cluster.

    <dir>/model.json          model config, the store's feature description (features, tables, sizes,
                              numeric transforms and ranges, hashing), the dataset declaration (no path)
    <dir>/weights.pt          the unsharded state dict but the embedding tables (tensors only: loaded with
                              ``weights_only``)
    <dir>/tables/<name>.f32   each embedding table, row-major float32 (:mod:`pipeline.model_folder.table_files`; shapes in
                              model.json): written in row blocks, memory-mapped for scoring; ``.u8``: its rows
                              quantized (``quantize`` in model.json: int8, int4 or fp16; :mod:`.quantize`)
    <dir>/vocab/<t>.parquet   each table's vocabulary (key uint64, training count), as in the store
    <dir>/zch.npz             ``model.zch`` models: each table's mapping of raw ids to rows (:func:`modules.embedding.zch.mapping.mapping_state`)

Written to ``<dir>.tmp-<pid>`` and renamed into place. :class:`pipeline.scoring.scorer.Scorer` turns raw rows — exactly as the
training files hold them — into probabilities: the same readers, feature extraction, vocabulary
lookup (unseen → OOV, missing → missing id) and numeric transforms as preprocessing, then the model
on the CPU. Every training run writes one (``<output>/model``; logged to MLflow as a pyfunc model,
:mod:`pipeline.tracking.pyfunc`); :mod:`pipeline.commands.export` writes one from a sharded checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modules.embedding.sparse_arch import is_table_parameter
from modules.embedding.table_precision import FOLDER_FORMAT
from modules.models import ModelConfig
from pipeline.data.dataset import DataConfig
from pipeline.model_folder.weights import ZCH_FILE, write_weights

BUNDLE_VERSION = 2  # 2: tables in tables/*.f32 (version 1 kept them in weights.pt; still read)
META_KEYS = ("dataset", "dense", "categorical", "sequence", "features", "transforms", "table_sizes", "dense_range",
             "preprocess", "vocabulary_day", "id_dtype")


def write_bundle(out: str | os.PathLike, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig,
                 data: DataConfig, store_meta: dict[str, Any], vocab_dir: Path, mlflow_run_id: str | None = None,
                 quantize: str = "none", zch_state: dict[str, np.ndarray] | None = None) -> Path:
    """Write the folder atomically, its tables quantized as ``quantize`` says (:mod:`.quantize`; ``none``: as
    ``model.table_precision`` stores them, fp16 rows as fp16), with the
    ``model.zch`` mapping ``zch_state`` if any; returns its path."""
    out = Path(out)
    if quantize == "none":  # the rows as trained: fp16 tables stay fp16 (modules/embedding/table_precision.py)
        quantize = FOLDER_FORMAT[model_cfg.table_precision]
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        declaration = {k: v for k, v in asdict(data).items() if k not in ("path", "synthetic", "shape_only",
                                                                            "cardinalities", "zipf_exponent")}
        tables = {k: list(v.shape) for k, v in state_dict.items() if is_table_parameter(k) and v.dim() == 2}
        description = {"version": BUNDLE_VERSION, "mlflow_run_id": mlflow_run_id, "model": asdict(model_cfg), "data": declaration,
                       "store": {k: store_meta[k] for k in META_KEYS if k in store_meta}, "tables": tables,
                       "quantize": quantize}
        (tmp / "model.json").write_text(json.dumps(description, indent=2, sort_keys=True))
        write_weights(tmp, state_dict, tables, quantize)
        if zch_state is not None:
            np.savez(tmp / ZCH_FILE, **zch_state)
        if vocab_dir.is_dir():
            shutil.copytree(vocab_dir, tmp / "vocab")
        else:  # hashed tables have no vocabulary
            (tmp / "vocab").mkdir()
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
