"""What a training step adds to a process's memory, for the host budget (:mod:`modules.sharding.placement`):
activations and their gradients, by the model's layer widths and looked-up rows."""

from __future__ import annotations

from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from modules.sharding.resident_memory import own_resident_bytes

Collection = EmbeddingBagCollection | EmbeddingCollection


def collection_tables(collection: Collection) -> list:
    """The table configs of a bag or sequence collection."""
    if isinstance(collection, EmbeddingBagCollection):
        return collection.embedding_bag_configs()
    return collection.embedding_configs()


STEP_COPIES = 4  # activations, their gradients, masks and the allocator's slack: measured +300 MB for DeepFM at
                 # batch 8,192 / eval 16,384 (docs/ssd_tier.md), estimated 216 MB by this rule
EVAL_COPIES = 2  # an evaluation step keeps no activations for a backward: a layer's input and output


def step_bytes(model: nn.Module, batch_rows: int, eval_rows: int = 0) -> int:
    """What a step adds to the process, the larger of a training step of ``batch_rows`` samples and an
    evaluation step of ``eval_rows``: ``STEP_COPIES`` (``EVAL_COPIES``) float32 copies of every Linear
    layer's output and of the looked-up rows (outputs of the collections)."""
    widths = sum(m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    rows = sum(c.embedding_dim * len(c.feature_names) for ebc in model.modules()
               if isinstance(ebc, (EmbeddingBagCollection, EmbeddingCollection)) for c in collection_tables(ebc))
    return 4 * max(STEP_COPIES * batch_rows, EVAL_COPIES * eval_rows) * (widths + rows)


def process_bytes(model: nn.Module, batch_rows: int, world_size: int, eval_rows: int = 0) -> int:
    """What one training process holds besides its tables (the CPU host budget, :mod:`modules.sharding.placement`): its
    resident memory now and what a step adds for its share of ``batch_rows`` / ``eval_rows`` (the samples of
    all ranks)."""
    world = max(1, world_size)
    return own_resident_bytes() + step_bytes(model, batch_rows // world, eval_rows // world)
