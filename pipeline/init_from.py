"""Starting a run from an earlier model's weights (``trainer.init_from``), with tables that may have grown.

The source is a model folder (a run's ``<output>/model``, :mod:`pipeline.export`'s) or a checkpoint
directory, written by any number of processes; the new run may have any world size (each rank fills
the rows of its own shards). Every dense parameter and buffer is copied as it is. An embedding table
whose vocabulary grew (``data.preprocess.base_vocabulary``: the earlier ids are kept) keeps the rows
of the ids it had, and its new rows keep their fresh initialisation; a first-order table (the rows of
several tables back to back, :func:`modules.embedding.wide_row_offsets`) is copied table by table,
since a grown table moves the ones after it. The optimizers' states start fresh.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from modules.embedding import EMB_PREFIX, WIDE_SEQ_TABLE, WIDE_TABLE, FeatureSpec, is_table_parameter, wide_row_offsets
from pipeline.model_bundle import BundleError, checkpoint_run, is_bundle


def source_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], FeatureSpec]:
    """(full state dict, feature spec) of a model folder or checkpoint."""
    from pipeline.checkpointing import full_model_state

    path = Path(path)
    if is_bundle(path):
        description = json.loads((path / "model.json").read_text())
        weights = torch.load(path / "weights.pt", weights_only=True, map_location="cpu")
        return weights, FeatureSpec.from_store_meta(description["store"])
    run = checkpoint_run(path)
    return full_model_state(run.path), FeatureSpec.from_store_meta(run.store.meta)


def lineage_tags(path: str | None) -> dict[str, str]:
    """MLflow tags of a run started from ``path``: the source and, where known, its MLflow run."""
    if not path:
        return {}
    tags = {"ctr.init_from": str(Path(path).resolve())}
    try:
        if is_bundle(path):
            run_id = json.loads((Path(path) / "model.json").read_text()).get("mlflow_run_id")
        else:
            from pipeline.checkpointing import read_rank0_state

            run_id = read_rank0_state(path)["pipeline"].get("mlflow_run_id")
    except (OSError, ValueError, KeyError):
        run_id = None  # the run itself reports an unreadable source, with its path
    return {**tags, **({"ctr.parent_run_id": run_id} if run_id else {})}


def _segments(spec: FeatureSpec, name: str) -> dict[str, tuple[int, int]]:
    """Table → (first row, rows) inside the parameter ``name`` (an ``emb_<t>`` table or a first-order table)."""
    table = name.split(".")[-2]
    if table in (WIDE_TABLE, WIDE_SEQ_TABLE):
        features = spec.bag_features if table == WIDE_TABLE else spec.seq_features
        offsets = wide_row_offsets(spec, features)
        return {spec.table_of(f): (offsets[f], spec.table_sizes[spec.table_of(f)]) for f in features}
    t = table[len(EMB_PREFIX):]
    return {t: (0, spec.table_sizes[t])}


def reused_positions(vocab_dir: Path, day: int) -> dict[str, np.ndarray]:
    """Per table, the vocabulary positions a new value took this ``day`` in place of an evicted one
    (:mod:`pipeline.data.vocab_growth`): their rows start afresh."""
    import pyarrow.parquet as pq

    out = {}
    for path in sorted(Path(vocab_dir).glob("*.parquet")):
        table = pq.read_table(path)
        if "since" in table.column_names and day > 0:
            out[path.stem] = np.flatnonzero(table.column("since").to_numpy() == day)
    return out


def row_sources(name: str, old: FeatureSpec, new: FeatureSpec, rows: int,
                reused: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """For each row of the new parameter ``name``, the row of the old one it continues (-1: a new row, or a
    row whose id now names another value: ``reused`` vocabulary positions, id = position + 2)."""
    source = np.full(rows, -1, dtype=np.int64)
    old_segments = _segments(old, name)
    for table, (start, n) in _segments(new, name).items():
        if table in old_segments:
            old_start, old_n = old_segments[table]
            if old_n > n:
                raise BundleError(f"trainer.init_from: table {table!r} had {old_n} rows, this run has {n}: the "
                                  f"vocabulary shrank (preprocess the new data with data.preprocess.base_vocabulary)")
            source[start:start + old_n] = np.arange(old_start, old_start + old_n)
            if reused and table in reused:
                source[start + 2 + reused[table]] = -1
    return source


def _copy_rows(target: torch.Tensor, row0: int, col0: int, source: np.ndarray, old: torch.Tensor) -> None:
    mapped = source[row0:row0 + target.shape[0]]
    keep = torch.from_numpy(np.flatnonzero(mapped >= 0))
    if len(keep):
        target[keep] = old[torch.from_numpy(mapped[keep.numpy()]), col0:col0 + target.shape[1]].to(target.dtype)


@torch.no_grad()
def initialize_from(model: nn.Module, path: str | Path, spec: FeatureSpec,
                    reused: dict[str, np.ndarray] | None = None) -> None:
    """Copy the weights of ``path`` into the (sharded) ``model`` of a run with ``spec`` (``reused``: see
    :func:`row_sources`). The source's MLflow run is named by :func:`lineage_tags`."""
    weights, old_spec = source_weights(path)
    state = model.state_dict()
    missing = sorted(set(state) - set(weights))
    if missing:
        raise BundleError(f"trainer.init_from={path}: the model there lacks {missing[:5]} — another model or "
                          f"dataset layout")
    for key, value in state.items():
        old = weights[key]
        if not is_table_parameter(key):
            if tuple(old.shape) != tuple(value.shape):
                raise BundleError(f"trainer.init_from={path}: {key} has shape {tuple(old.shape)}, this model "
                                  f"{tuple(value.shape)} (model settings differ)")
            value.copy_(old)
            continue
        size = tuple(value.size()) if hasattr(value, "local_shards") else tuple(value.shape)
        if old.shape[1] != size[1]:
            raise BundleError(f"trainer.init_from={path}: {key} has {old.shape[1]} columns, this model {size[1]}")
        source = row_sources(key, old_spec, spec, size[0], reused)
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                r0, c0 = shard.metadata.shard_offsets
                _copy_rows(shard.tensor, r0, c0, source, old)
        else:
            _copy_rows(value, 0, 0, source, old)
