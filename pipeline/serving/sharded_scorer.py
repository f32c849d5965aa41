"""Scoring a checkpoint with its tables sharded as in training (``torchrun ... ctr predict``): every rank
scores its contiguous share of each block through the sharded model (every rank runs the same number
of steps) and rank 0 gathers the probabilities."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from modules.models import build_model
from modules.optim.optimizers import OptimizerSpec
from modules.sharding.planner import shard_model
from modules.sharding.topology import TopologySpec
from pipeline.checkpoint.chunks import row_chunks
from pipeline.checkpoint.safe_reader import SafeFileSystemReader
from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import BundleError
from pipeline.serving.row_encoder import RowEncoder
from pipeline.serving.scorer import score_batches
from pipeline.serving.source import model_source
from pipeline.serving.weights import read_zch_state


def sharded_scorer(checkpoint: Path, batch_size: int) -> tuple[RowEncoder, Callable[[SplitArrays], np.ndarray | None]]:
    """The checkpoint's model sharded over the process group (as in training), and a scoring function
    that splits each block over the ranks and gathers the probabilities on rank 0."""
    source = model_source(checkpoint)
    if not source.is_checkpoint:
        raise BundleError(f"{checkpoint}: under torchrun, predict scores a checkpoint with its tables sharded; "
                          f"score a model folder in one process")
    encoder = RowEncoder(source.store_meta, source.data, source.vocab_root, read_zch_state(source))
    spec = encoder.spec
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
        rows = np.where(rows < n, rows, 0)  # padding rows (row 0) keep every rank's step count equal
        local = score_batches(dmp, spec, arrays, batch_size, rows)
        gathered = [torch.empty(share) for _ in range(world)]
        dist.all_gather(gathered, torch.from_numpy(local))
        return torch.cat(gathered)[:n].numpy() if rank == 0 else None

    return encoder, score
