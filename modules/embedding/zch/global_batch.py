"""The global batch's ids for the remapper (:mod:`modules.embedding.zch.remapper`) on several ranks.

Every rank keeps the whole mapping and admits the global batch's ids, so every rank's remapper stays the same:
admission depends on the ids and their counts, not on their order (``torch.unique``), so it is the mapping one
process builds from the same global batches. The step's latest row time (``model.zch.ttl_clock=time``) is the
maximum over the ranks, so every rank's clock is the same too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_ids(per_table: dict[str, torch.Tensor], time: int = -1) -> tuple[dict[str, torch.Tensor], int]:
    """(every rank's ids of a step per table — the ranks' ids one after the other —, the latest of the ranks'
    ``time``): two all-gathers, one of the sizes (and times), one of the ids."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return per_table, time
    sizes = torch.tensor([*(len(v) for v in per_table.values()), time], dtype=torch.int64)
    flat = torch.cat(list(per_table.values())) if per_table else torch.zeros(0, dtype=torch.int64)
    world = dist.get_world_size()
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    latest = int(max(int(s[-1]) for s in all_sizes))
    all_sizes = [s[:-1] for s in all_sizes]
    longest = int(max(int(s.sum()) for s in all_sizes))
    padded = torch.zeros(longest, dtype=torch.int64)
    padded[:len(flat)] = flat
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    parts = [torch.split(g[:int(s.sum())], s.tolist()) for g, s in zip(gathered, all_sizes)]
    return {t: torch.cat([p[i] for p in parts]) for i, t in enumerate(per_table)}, latest
