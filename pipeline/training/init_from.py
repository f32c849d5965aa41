"""Starting a run from an earlier model's weights (``trainer.init_from``), with tables that may have grown.

The source is a model folder (a run's ``<output>/model``, ``ctr export``'s) or a checkpoint
directory, written by any number of processes; the new run may have any world size (each rank fills
the rows of its own shards). Every dense parameter and buffer is copied as it is. An embedding table
whose vocabulary grew (``data.preprocess.base_vocabulary``: the earlier ids are kept) keeps the rows
of the ids it had, and its new rows keep their fresh initialisation; a first-order table (the rows of
several tables back to back, :func:`modules.embedding.sparse_arch.wide_row_offsets`) is copied table by table,
since a grown table moves the ones after it.

The optimizers' states start fresh unless ``trainer.init_from_optimizer`` says otherwise (a checkpoint
only; a model folder holds weights alone): ``embedding`` carries the fused embedding optimizer's state
(row-wise Adagrad's accumulator, Adam's moments: one row per table row, mapped like the weights; new
rows start at 0) and the state of data-parallel tables' optimizer (:mod:`modules.optim.optimizers`);
``dense`` the dense optimizer's state (Adam's moments and step count); ``all`` both. Learning rates and
the schedule are always the new run's own.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from modules.embedding.sparse_arch import FeatureSpec, is_table_parameter
from modules.embedding.row_reset import table_segments
from pipeline.checkpoint.skeleton import PER_COPY
from pipeline.checkpoint.full_state import full_model_state
from pipeline.data.store import FIRST_VOCAB_ID
from pipeline.data.vocab_files import read_vocabulary
from pipeline.runtime.errors import BundleError, ConfigError
from pipeline.model_folder import table_files
from pipeline.model_folder.source import ModelSource, is_model_folder, model_source
from pipeline.model_folder.weights import read_float_weights


def init_source(path: str | None) -> ModelSource | None:
    """The model folder or checkpoint ``trainer.init_from`` names, resolved and checked once per run (a
    checkpoint's files are hashed against its manifest); every step below takes this, not the path."""
    return model_source(path) if path else None


def source_weights(source: ModelSource, table_dir: Path) -> tuple[dict[str, torch.Tensor], FeatureSpec]:
    """(full state dict, feature spec) of a model folder or checkpoint; tables mapped from files (a
    checkpoint's are read into ``table_dir``)."""
    return read_float_weights(source, table_dir), FeatureSpec.from_store_meta(source.store_meta)


def check_optimizer_source(path: str | None, parts: str) -> None:
    """Refuse, before anything runs, to carry optimizer state from a model folder (it holds weights only)."""
    if path and parts != "none" and is_model_folder(path):
        raise ConfigError(f"trainer.init_from_optimizer={parts}: {path} is a model folder, which holds weights only; "
                          f"set trainer.init_from to a checkpoint directory (the earlier run's trainer.checkpoint.dir)")


def source_optimizer_state(source: ModelSource) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], FeatureSpec]:
    """(fused embedding-optimizer state ``{"<parameter>/<state>": full tensor}``, rank 0's optimizer
    state ``{"[<member>/]state/<i>/<name>": tensor}``, feature spec) of a checkpoint."""
    fused = full_model_state(source.path, "fused_optimizer/") or full_model_state(source.path, f"{PER_COPY}0/")
    return (fused,  # (a run with copies of the tables: copy 0's, rank 0's)
            full_model_state(source.path, "rank0/optimizer_states/0/"), FeatureSpec.from_store_meta(source.store_meta))


def lineage_tags(source: ModelSource | None) -> dict[str, str]:
    """MLflow tags of a run started from ``source``: its path and, where known, its MLflow run."""
    if source is None:
        return {}
    tags = {"ctr.init_from": str(source.path.resolve())}
    return {**tags, **({"ctr.parent_run_id": source.mlflow_run_id} if source.mlflow_run_id else {})}


def _segments(spec: FeatureSpec, name: str) -> dict[str, tuple[int, int]]:
    """Table → (first row, rows) inside the parameter ``name`` (an ``emb_<t>`` table or a first-order table)."""
    return table_segments(spec, name.split(".")[-2])


def reused_positions(vocab_dir: Path, day: int) -> dict[str, np.ndarray]:
    """Per table, the vocabulary positions a new value took this ``day`` in place of an evicted one
    (:mod:`pipeline.data.vocab_growth`): their rows start afresh."""
    out = {}
    if day <= 0:
        return out
    for path in sorted(Path(vocab_dir).glob("*.parquet")):
        vocab = read_vocabulary(Path(vocab_dir).parent, path.stem, columns=("since",))
        if vocab is not None:
            out[path.stem] = np.flatnonzero(vocab.since == day)
    return out


def row_sources(name: str, old: FeatureSpec, new: FeatureSpec, rows: int,
                reused: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """For each row of the new parameter ``name``, the row of the old one it continues (-1: a new row, or a
    row whose id now names another value: ``reused`` vocabulary positions, id = position + FIRST_VOCAB_ID)."""
    source = np.full(rows, -1, dtype=np.int64)
    old_segments = _segments(old, name)
    for table, (start, n) in _segments(new, name).items():
        if table in old_segments:
            old_start, old_n = old_segments[table]
            if old_n > n:
                raise BundleError(f"trainer.init_from: table {table!r} had {old_n} rows, this run has {n}: the "
                                  f"vocabulary shrank: keep the source's ids with data.preprocess.base_vocabulary=auto (the "
                                  f"default) or =<its model folder or store>")
            source[start:start + old_n] = np.arange(old_start, old_start + old_n)
            if reused and table in reused:
                source[start + FIRST_VOCAB_ID + reused[table]] = -1
    return source


def _copy_rows(target: torch.Tensor, offsets: tuple[int, ...] | list[int], source: np.ndarray,
               old: torch.Tensor) -> None:
    """Rows of ``target`` (the block of a table — or of a per-row state vector — at ``offsets``) from
    the rows ``source`` names in the full ``old``; rows named -1 are left as they are."""
    mapped = source[offsets[0]:offsets[0] + target.shape[0]]
    step = table_files.rows_per_block(4 * (target.shape[1] if target.dim() == 2 else 1))
    for start in range(0, len(mapped), step):  # in row blocks: a file-backed table is never whole in memory
        part = mapped[start:start + step]
        keep = np.flatnonzero(part >= 0)
        if len(keep):
            rows = old[torch.from_numpy(part[keep])]
            if target.dim() == 2:
                rows = rows[:, offsets[1]:offsets[1] + target.shape[1]]
            target[torch.from_numpy(start + keep).to(target.device)] = rows.to(target.device, target.dtype)


def _copy_table(value: Any, key: str, old: torch.Tensor, source: np.ndarray) -> None:
    """Fill a (sharded) table-shaped tensor ``value`` from the full ``old`` through ``source``."""
    size = tuple(value.size())  # a tensor's or a ShardedTensor's whole shape
    if tuple(old.shape[1:]) != size[1:]:
        raise BundleError(f"{key} has shape {tuple(old.shape)} there, {size} here (model settings differ)")
    if hasattr(value, "local_shards"):
        for shard in value.local_shards():
            _copy_rows(shard.tensor, shard.metadata.shard_offsets, source, old)
    else:
        _copy_rows(value, (0, 0), source, old)


@torch.no_grad()
def initialize_from(model: nn.Module, source: ModelSource, spec: FeatureSpec,
                    reused: dict[str, np.ndarray] | None = None) -> None:
    """Copy the weights of ``source`` into the (sharded) ``model`` of a run with ``spec`` (``reused``: see
    :func:`row_sources`). The source's MLflow run is named by :func:`lineage_tags`."""
    with tempfile.TemporaryDirectory(prefix="ctr-init-from-") as scratch:
        _initialize(model, source.path, spec, reused, *source_weights(source, Path(scratch)))


def _initialize(model: nn.Module, path: str | Path, spec: FeatureSpec, reused: dict[str, np.ndarray] | None,
                weights: dict[str, torch.Tensor], old_spec: FeatureSpec) -> None:
    state = model.state_dict()
    missing = sorted(set(state) - set(weights))
    if missing:
        raise BundleError(f"trainer.init_from={path}: the model there lacks {missing[:5]} — another model or "
                          f"dataset layout")
    try:
        for key, value in state.items():
            old = weights[key]
            if not is_table_parameter(key):
                if tuple(old.shape) != tuple(value.shape):
                    raise BundleError(f"{key} has shape {tuple(old.shape)} there, {tuple(value.shape)} here "
                                      f"(model settings differ)")
                value.copy_(old)
                continue
            _copy_table(value, key, old, row_sources(key, old_spec, spec, value.size()[0], reused))
    except BundleError as e:
        raise BundleError(f"trainer.init_from={path}: {e}") from None


def _optimizer_state(flat: dict[str, torch.Tensor], member: str | None) -> dict[int, dict[str, torch.Tensor]]:
    """``{"[<member>/]state/<i>/<name>": t}`` → ``{i: {name: t}}`` for one optimizer."""
    prefix = f"{member}/state/" if member else "state/"
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith(prefix):
            index, name = key[len(prefix):].split("/", 1)
            out.setdefault(int(index), {})[name] = value
    return out


@torch.no_grad()
def carry_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, source: ModelSource,
                          spec: FeatureSpec, parts: str, reused: dict[str, np.ndarray] | None = None) -> None:
    """Load the optimizer state of the checkpoint ``source`` named by ``parts`` (module docstring) into this
    run's fused embedding optimizer and its ``optimizer`` (a torch optimizer or an ``OptimizerChain``
    with members ``dense`` and ``embedding``), mapping table rows as :func:`initialize_from` does."""
    from modules.optim.optimizers import replicated_parameters

    if parts == "none":
        return
    setting = f"trainer.init_from_optimizer={parts}"
    fused_old, flat, old_spec = source_optimizer_state(source)

    def rows_of(name: str, value: Any) -> np.ndarray:
        return row_sources(name, old_spec, spec, value.size()[0], reused)

    try:
        fused = getattr(model, "fused_optimizer", None)
        if parts in ("embedding", "all") and fused is not None and fused.param_groups:
            sd = fused.state_dict()
            for name, states in sd["state"].items():
                for state_name, value in states.items():
                    key = f"{name}/{state_name}"
                    if key not in fused_old:
                        raise BundleError(f"the checkpoint has no {key} (another embedding optimizer?)")
                    if len(value.size()):
                        _copy_table(value, key, fused_old[key], rows_of(name, value))
                    else:
                        value.copy_(fused_old[key])  # a scalar, e.g. a step count
            fused.load_state_dict(sd)
        members = getattr(optimizer, "optimizers", {"dense": optimizer})
        chained = hasattr(optimizer, "optimizers")
        tables = [n for n, _ in replicated_parameters(model) if is_table_parameter(n)]
        for member, opt in members.items():
            if parts not in ("all", member):
                continue
            params = [p for g in opt.param_groups for p in g["params"]]
            old = _optimizer_state(flat, member if chained else None)
            state: dict[int, dict[str, torch.Tensor]] = {}
            for i, p in enumerate(params):
                if i not in old:
                    continue  # no state there (a parameter never stepped): fresh here too
                state[i] = {}
                for name, t in old[i].items():
                    if t.dim() == 0:
                        state[i][name] = t.clone()
                    elif member == "embedding":  # a data-parallel table's state: rows mapped, new rows 0
                        state[i][name] = t.new_zeros((p.shape[0], *t.shape[1:]))
                        _copy_table(state[i][name], f"{tables[i]}/{name}", t, rows_of(tables[i], p))
                    elif tuple(t.shape) != tuple(p.shape):
                        raise BundleError(f"{member} optimizer state {i}/{name} has shape {tuple(t.shape)} there, "
                                          f"the parameter {tuple(p.shape)} here (model settings differ)")
                    else:
                        state[i][name] = t.clone()
            opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    except BundleError as e:
        raise BundleError(f"{setting} ({source.path}): {e}") from None
