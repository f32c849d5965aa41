"""A trained model as one self-contained folder: everything scoring raw rows needs, no training cluster.

    <dir>/model.json          model config, the store's feature description (features, tables, sizes,
                              numeric transforms and ranges, hashing), the dataset declaration (no path)
    <dir>/weights.pt          the unsharded state dict but the embedding tables (tensors only: loaded with
                              ``weights_only``)
    <dir>/tables/<name>.f32   each embedding table, row-major float32 (:mod:`pipeline.serving.table_files`; shapes in
                              model.json): written in row blocks, memory-mapped for scoring
    <dir>/vocab/<t>.parquet   each table's vocabulary (key uint64, training count), as in the store

Written to ``<dir>.tmp-<pid>`` and renamed into place. :class:`Scorer` turns raw rows — exactly as the
training files hold them — into probabilities: the same readers, feature extraction, vocabulary
lookup (unseen → OOV, missing → missing id) and numeric transforms as preprocessing, then the model
on the CPU. Every training run writes one (``<output>/model``; logged to MLflow as a pyfunc model,
:mod:`pipeline.tracking.pyfunc`); :mod:`pipeline.commands.export` writes one from a sharded checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf

from modules.embedding import FeatureSpec, is_table_parameter
from pipeline.serving import table_files
from modules.models import ModelConfig, build_model
from pipeline.data.dataset import DataConfig
from pipeline.data.features import FeatureBlock, extract
from pipeline.data.hashing import factorized_string_keys
from pipeline.data.preprocess import encode_ids, transform_dense
from pipeline.data.store import ColumnarStore, Ragged, SplitArrays
from pipeline.data.vocab_growth import VocabIndex

BUNDLE_VERSION = 2  # 2: tables in tables/*.f32 (version 1 kept them in weights.pt; still read)
META_KEYS = ("dataset", "dense", "categorical", "sequence", "features", "transforms", "table_sizes", "dense_range",
             "preprocess", "vocabulary_day")


class BundleError(ValueError):
    """A model folder that cannot be read (missing or damaged file), or input it cannot score."""


def write_bundle(out: str | os.PathLike, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig,
                 data: DataConfig, store_meta: dict[str, Any], vocab_dir: Path, mlflow_run_id: str | None = None) -> Path:
    """Write the folder atomically; returns its path."""
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        declaration = {k: v for k, v in asdict(data).items() if k not in ("path", "synthetic", "shape_only",
                                                                            "cardinalities", "zipf_exponent")}
        tables = {k: list(v.shape) for k, v in state_dict.items() if is_table_parameter(k) and v.dim() == 2}
        description = {"version": BUNDLE_VERSION, "mlflow_run_id": mlflow_run_id, "model": asdict(model_cfg), "data": declaration,
                       "store": {k: store_meta[k] for k in META_KEYS if k in store_meta}, "tables": tables}
        (tmp / "model.json").write_text(json.dumps(description, indent=2, sort_keys=True))
        for key in tables:
            table_files.write(tmp / "tables" / f"{key}.f32", state_dict[key])
        torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k not in tables},
                   tmp / "weights.pt")
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


def is_bundle(path: str | os.PathLike) -> bool:
    return (Path(path) / "model.json").is_file()


def read_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A model folder's state dict: ``weights.pt`` and its tables memory-mapped (read-only)."""
    folder = Path(folder)
    try:
        tables = json.loads((folder / "model.json").read_text()).get("tables", {})
        weights = torch.load(folder / "weights.pt", weights_only=True, map_location="cpu")
        weights.update({k: table_files.mapped(folder / "tables" / f"{k}.f32", shape) for k, shape in tables.items()})
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise BundleError(f"{folder}: cannot load the weights ({e})") from None
    return weights


def unsharded_state(module: torch.nn.Module, table_dir: Path) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict of a (DMP-wrapped) model on rank 0, None on other ranks (collective:
    every rank must call it). Embedding tables are written to ``table_dir`` by the ranks holding their
    shards and mapped (:func:`pipeline.serving.table_files.unshard_to_file`); other sharded tensors are gathered."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if torch.distributed.is_initialized():  # rank 0's folder: the ranks' output folders may differ
        agreed = [str(table_dir)]
        torch.distributed.broadcast_object_list(agreed, src=0)
        table_dir = Path(agreed[0])
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        if is_table_parameter(key) and len(value.size()) == 2:
            value = table_files.unshard_to_file(value, table_dir / f"{key}.f32")
        elif hasattr(value, "local_shards"):
            full = torch.empty(tuple(value.size()), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=full)
            value = full
        if rank == 0:
            out[key] = value.detach().cpu()
    return out if rank == 0 else None


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


def checkpoint_run(checkpoint: str | os.PathLike) -> CheckpointRun:
    """The checkpoint's run description (checked against its manifest first); the store it trained on
    must be on this machine (its vocabularies)."""
    from pipeline.checkpoint.checkpointing import checked_checkpoint, read_rank0_state  # not needed to serve a model folder

    path = checked_checkpoint(checkpoint)
    run = read_rank0_state(path)["pipeline"].get("run")
    if run is None:
        raise BundleError(f"{path}: the checkpoint does not describe its model and data (written by an older "
                          f"version); use the model folder of a newer run instead")
    try:
        store = ColumnarStore(run["store"])
    except (FileNotFoundError, ValueError) as e:
        raise BundleError(f"{path}: the store the run trained on is needed for its vocabularies: {e}") from None
    return CheckpointRun(path, ModelConfig(**run["model"]), declaration_from(run["data"]), store)


class RowEncoder:
    """Raw rows → the store's encoding: the declaration's readers and features, the tables' vocabularies
    (or hashing), the numeric transforms and training ranges of ``meta`` (a store's or a bundle's)."""

    def __init__(self, meta: dict[str, Any], data: DataConfig, vocab_dir: Path) -> None:
        self.meta, self.data, self.vocab_dir = meta, data, vocab_dir
        self.spec = FeatureSpec.from_store_meta(meta)
        self.hash_buckets = int(meta["preprocess"]["hash_buckets"])
        hashed = meta["preprocess"]["categorical"] == "hash"
        self.index = {} if hashed else {t: self._vocabulary(t) for t in meta["table_sizes"]}
        ranges = meta.get("dense_range", {})
        self.transforms = [meta["transforms"][f] for f in self.spec.dense]
        self.lo = np.array([ranges.get(f, [0.0, 0.0])[0] for f in self.spec.dense])
        self.hi = np.array([ranges.get(f, [0.0, 0.0])[1] for f in self.spec.dense])

    def _vocabulary(self, table: str) -> VocabIndex:
        path = self.vocab_dir / f"{table}.parquet"
        try:
            keys = pq.read_table(path, columns=["key"]).column("key").to_numpy()
        except (OSError, pa.ArrowException, KeyError) as e:
            raise BundleError(f"{path}: cannot read the vocabulary of table {table!r} ({e})") from None
        if len(keys) != self.meta["table_sizes"][table] - 2:
            raise BundleError(f"{path}: {len(keys)} values, expected {self.meta['table_sizes'][table] - 2} "
                              f"(table {table!r}): a damaged vocabulary file")
        return VocabIndex(keys)

    def reading(self, label: bool) -> DataConfig:
        """The declaration to read raw rows with (without the label column when ``label`` is False)."""
        data = declaration_from(asdict(self.data))
        if not label:
            data.label = ""
            if data.columns:
                data.columns = [c for c in data.columns if c != self.data.label]
        return data

    def encode(self, block: FeatureBlock) -> SplitArrays:
        """Ids and transformed numbers of a block of raw features."""
        tables = [self.spec.table_of(f) for f in (*self.spec.categorical, *self.spec.sequence)]
        ids = []
        for values, table in zip(block.sparse, tables):
            codes, distinct = factorized_string_keys(values)
            ids.append(encode_ids(distinct, codes, self.index.get(table), self.hash_buckets))
        n_cat = len(self.spec.categorical)
        sparse = np.stack(ids[:n_cat], axis=1) if n_cat else np.zeros((block.rows, 0), np.int32)
        sequences = {f: Ragged(ids[n_cat + j], np.concatenate([[0], np.cumsum(block.lengths[n_cat + j])]))
                     for j, f in enumerate(self.spec.sequence)}
        dense = transform_dense(block.numeric, self.transforms, self.lo, self.hi)
        return SplitArrays(block.label, dense, sparse, sequences)

    def frame_block(self, frame: pd.DataFrame) -> FeatureBlock:
        """The features of a DataFrame of raw columns (as a training file holds them; no label needed)."""
        data = self.reading(label=False)
        missing = [c for c in data.read_columns if c not in frame.columns]
        if missing:
            raise BundleError(f"input lacks column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                              f"(the model reads {list(data.read_columns)}); it has {list(frame.columns)[:40]}")
        columns = {}
        for c in data.read_columns:
            values = frame[c]
            if c in data.number_columns:
                columns[c] = pa.array(pd.to_numeric(values, errors="raise"), pa.float64())
            elif values.map(lambda v: isinstance(v, (list, tuple, np.ndarray))).any():
                columns[c] = pa.array([None if v is None else [str(x) for x in v] for v in values],
                                      pa.list_(pa.string()))
            else:
                columns[c] = pa.array([None if _missing(v) else str(v) for v in values], pa.string())
        return extract(pa.table(columns), data, lambda i: f"row {i}", {})


def score_batches(model: torch.nn.Module, spec: FeatureSpec, arrays: SplitArrays, batch_size: int = 65536,
                  rows: np.ndarray | None = None) -> np.ndarray:
    """Click probabilities of ``rows`` of ``arrays`` (default: every row), in that order (the model in eval
    mode, no gradients)."""
    from pipeline.data.batches import make_batch

    rows = np.arange(len(arrays)) if rows is None else rows
    out = np.empty(len(rows), np.float32)
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            batch = make_batch(arrays, part, spec.kjt_keys, categorical=spec.categorical)
            out[start:start + len(part)] = torch.sigmoid(model(batch.dense_features, batch.sparse_features)).float().numpy()
    return out


class Scorer(RowEncoder):
    """A bundle loaded for scoring on the CPU (see module docstring)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        try:
            description = json.loads((self.folder / "model.json").read_text())
        except (OSError, ValueError) as e:
            raise BundleError(f"{self.folder / 'model.json'}: cannot read the model description ({e})") from None
        super().__init__(description["store"], declaration_from(description["data"]), self.folder / "vocab")
        self.model_cfg = ModelConfig(**description["model"])
        self.model = build_model(self.model_cfg, self.spec, device=torch.device("meta"))
        try:  # assign: the mapped tables become the parameters (no copy into fresh tables)
            self.model.load_state_dict(read_weights(self.folder), assign=True)
        except RuntimeError as e:
            raise BundleError(f"{self.folder}: the weights do not fit the model ({e})") from None
        self.model.eval()

    def score(self, arrays: SplitArrays, batch_size: int = 65536) -> np.ndarray:
        return score_batches(self.model, self.spec, arrays, batch_size)

    def score_frame(self, frame: pd.DataFrame) -> np.ndarray:
        """Probabilities of the rows of a DataFrame of raw columns."""
        return self.score(self.encode(self.frame_block(frame)))


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA or v == ""

