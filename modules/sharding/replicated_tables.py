"""Every embedding table whole on every rank (``trainer.merging.tables=replicated``), merged sparsely.

Each rank shards its collections over a process group of its own (one rank: TorchRec's kernels, fused
optimizer, CowClip and checkpoints as with sharded tables, no all-to-all across the link); a
:class:`~modules.optim.sparse_merging.TableMerger` sees every training lookup through a forward pre-hook
on the collections and merges the looked-up rows every ``k`` steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modules.optim.sparse_merging import TableMerger

_own_group: dist.ProcessGroup | None = None


def own_group() -> dist.ProcessGroup:
    """A process group of this rank alone (made once, collectively, on first call)."""
    global _own_group
    if _own_group is None:
        _own_group, _ = dist.new_subgroups(group_size=1)
    return _own_group


def _tables(module: nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(feature → table, table → its whole weight on this rank) of a sharded collection."""
    if isinstance(module, ShardedEmbeddingBagCollection):
        configs, prefix = module._embedding_bag_configs, "embedding_bags"
    else:
        configs, prefix = module._embedding_configs, "embeddings"
    state = module.state_dict()
    weights = {}
    for c in configs:
        weight = state[f"{prefix}.{c.name}.weight"]
        shards = weight.local_shards()
        if len(shards) != 1 or tuple(shards[0].tensor.shape) != (c.num_embeddings, c.embedding_dim):
            raise ValueError(f"table {c.name}: not whole on this rank (sharded over more than one rank)")
        weights[c.name] = shards[0].tensor
    return {f: c.name for c in configs for f in c.feature_names}, weights


def attach_table_merger(model: nn.Module, updates: str = "fp32") -> TableMerger:
    """A merger of every table of ``model`` (sharded over :func:`own_group`), told each training lookup, sending
    its updates in ``updates`` precision (fp32 or fp16)."""
    collections = [m for m in model.modules()
                   if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection))]
    found = [_tables(m) for m in collections]
    merger = TableMerger({name: w for _, weights in found for name, w in weights.items()}, updates)
    for module, (table_of, _) in zip(collections, found):
        def record(mod: nn.Module, args: tuple, table_of: dict[str, str] = table_of) -> None:
            if not mod.training:
                return
            kjt: KeyedJaggedTensor = args[0]  # each key's ids, moved to its table's rows in the merger's one index
            first = torch.tensor([merger.first_row[table_of[key]] for key in kjt.keys()])
            merger.record_rows(kjt.values().to(torch.int64)
                               + first.repeat_interleave(torch.tensor(kjt.length_per_key())))
        module.register_forward_pre_hook(record)
    return merger
