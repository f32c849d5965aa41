"""Scoring a checkpoint with its tables sharded as in training (``torchrun ... ctr predict``): every rank
scores its contiguous share of each block through the sharded model (every rank runs the same number
of steps) and rank 0 gathers the probabilities. A ``model.zch`` model's mapping stays split too: each rank
reads its units of it and maps the ids of every rank's batch (:mod:`modules.embedding.zch.exchange`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from modules.embedding.feature_spec import FeatureSpec
from modules.embedding.zch.config import ZchConfig
from modules.embedding.zch.mapping import load_mapping_state
from modules.embedding.zch.remapper import ZchRemapper
from modules.models import build_model
from modules.optim.optimizers import OptimizerSpec
from modules.sharding.planner import shard_model
from modules.sharding.topology import TopologySpec
from pipeline.checkpoint.chunks import row_chunks
from pipeline.checkpoint.full_state import full_model_state
from pipeline.checkpoint.safe_reader import SafeFileSystemReader
from pipeline.data.store import Ragged, SplitArrays
from pipeline.runtime.errors import BundleError
from pipeline.scoring.row_encoder import RowEncoder
from pipeline.scoring.scorer import score_batches
from pipeline.model_folder.source import model_source


def sharded_scorer(checkpoint: Path, batch_size: int) -> tuple[RowEncoder, Callable[[SplitArrays], np.ndarray | None]]:
    """The checkpoint's model sharded over the process group (as in training), and a scoring function
    that splits each block over the ranks and gathers the probabilities on rank 0."""
    source = model_source(checkpoint)
    if not source.is_checkpoint:
        raise BundleError(f"{checkpoint}: under torchrun, predict scores a checkpoint with its tables sharded; "
                          f"score a model folder in one process")
    zch = source.model_cfg.zch
    # model.zch: raw ids stay raw and each rank maps them through its units of the mapping (as in training)
    encoder = RowEncoder(source.store_meta, source.data, source.vocab_root, keep_raw=True) if zch.enabled else \
        RowEncoder(source.store_meta, source.data, source.vocab_root)
    spec = encoder.spec
    remapper = _remapper(source.path, zch, spec) if zch.enabled else None
    net = build_model(source.model_cfg, spec, device=torch.device("meta"))
    # any fused optimizer: nothing is trained; SGD keeps no state
    dmp, _ = shard_model(net, OptimizerSpec("sgd", 0.0), TopologySpec(compute_device="cpu"), torch.device("cpu"),
                         table_of={f: spec.table_of(f) for f in spec.sparse})
    live = {f"state_dict/model.{k}": v for k, v in dmp.state_dict().items()}
    dcp.load(row_chunks(live), storage_reader=SafeFileSystemReader(str(source.path)))  # chunk by chunk
    dmp.eval()
    rank, world = dist.get_rank(), dist.get_world_size()

    def score(arrays: SplitArrays) -> np.ndarray | None:
        n = len(arrays)
        share = max(1, math.ceil(n / world))
        rows = np.arange(rank * share, (rank + 1) * share)
        padded = (rank + 1) * share > n  # padding rows keep every rank's step count equal: all values missing
        rows = np.where(rows < n, rows, n)
        local = score_batches(dmp, spec, SplitArrays.concat([arrays, _missing_row(arrays)]) if padded else arrays,
                              batch_size, rows, remapper)
        if remapper is not None:  # raw ids not held at training, over the ranks (padding rows have none)
            counts = remapper.take_counts().values()
            encoder.unseen += sum(c["unknown"] for c in counts)
            encoder.raw_values += sum(c["looked_up"] for c in counts)
        gathered = [torch.empty(share) for _ in range(world)]
        dist.all_gather(gathered, torch.from_numpy(local))
        return torch.cat(gathered)[:n].numpy() if rank == 0 else None

    return encoder, score


def _remapper(path: Path, cfg: ZchConfig, spec: FeatureSpec) -> ZchRemapper:
    """The read-only ``model.zch`` remapper of a checkpoint on this rank: only its units' mapping is read."""
    remapper = ZchRemapper.of(cfg, spec)
    mine = tuple(f"mch.{unit}." for unit in remapper.mch)
    state = full_model_state(path, "state_dict/zch.remapper.", keep=lambda k: k.startswith(mine))
    load_mapping_state(remapper, {k: v.numpy() for k, v in state.items()})
    return remapper.eval()


def _missing_row(arrays: SplitArrays) -> SplitArrays:
    """One row of ``arrays``' layout with every value missing (id 0, no sequence ids, zero numbers)."""
    return SplitArrays(np.zeros(1, arrays.label.dtype), np.zeros((1, *arrays.dense.shape[1:]), arrays.dense.dtype),
                       np.zeros((1, *arrays.sparse.shape[1:]), arrays.sparse.dtype),
                       {f: Ragged(np.zeros(0, r.values.dtype), np.zeros(2, np.int64)) for f, r in arrays.sequences.items()})
