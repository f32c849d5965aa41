"""``model.zch.spare_known``: held ids that the run's training data holds are evicted last — the look-ahead a
vocabulary with ``evict_after`` has, without a vocabulary.

A vocabulary is counted before its day trains, so its table holds exactly the ids the day will meet and keeps
them all day; a ZCH table fills as ids arrive and, once full, must guess which held ids will come back (LRU,
LFU, ...): at equal rows it evicts some that do (docs/incremental.md). When the data is stored before it
trains (``ctr daily``, any run on a store), the ids it holds are known: K_t, the distinct ids of table t in
the training split — sorted, 8 bytes a distinct id, read from the stored columns when the run starts (no
vocabulary: no row for an id, no counts, no pass over the raw files). At each admission round the held and
new ids are ranked by

    (id ∈ K_t, the policy's score)        lexicographically, descending; held ids only can be ∉ K_t

and the top N keep or take a row (TorchRec's MCH selection, stable): every held id the data does not hold
is evicted before any it does, and within each group the policy's order stands. A new id of the round is in
K_t by construction (it was just met). With room for K_t, no id the data meets loses its row to another;
without, the policy decides among them as before.

Refused with ``eviction=ttl``: a TTL keeps unexpired ids by its own rule. A stream that is not stored before
it trains has no K_t: this is for runs on a store.
"""

from __future__ import annotations

import numpy as np
import torch
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy


def distinct_ids(columns: list[np.ndarray]) -> torch.Tensor:
    """K_t: the distinct nonzero ids (0 = missing) of a table's stored columns, sorted (int64)."""
    parts = [np.unique(np.asarray(c, dtype=np.int64)) for c in columns]
    ids = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    return torch.from_numpy(ids[ids != 0])


def held_unknown(known: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """[len(held)] bool: the held ids (a table's MCH ``_mch_sorted_raw_ids``) not in ``known`` (sorted); the
    last position — MCH's sentinel row — never."""
    if len(known):
        at = torch.searchsorted(known, held).clamp_(max=len(known) - 1)
        out = known[at] != held
    else:
        out = torch.ones(len(held), dtype=torch.bool)
    out[-1] = False
    return out


class SpareKnown:
    """Mixed into a TorchRec MCH eviction policy (:data:`SPARING`): the selection ranks held ids in
    :attr:`unknown` below all others (module docstring); :attr:`unknown` is set before each round by
    :class:`modules.embedding.zch.remapper.ZchRemapper`."""

    unknown: torch.Tensor | None = None

    def _compute_selected_eviction_and_replacement_indices(self, pivot: int, eviction_scores: torch.Tensor
                                                           ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.unknown is None:
            return super()._compute_selected_eviction_and_replacement_indices(pivot, eviction_scores)  # type: ignore[misc]
        demoted = torch.zeros(len(eviction_scores), dtype=torch.int8)
        demoted[:pivot] = self.unknown.to(torch.int8)
        by_score = torch.argsort(eviction_scores, descending=True, stable=True)
        order = by_score[torch.sort(demoted[by_score], stable=True).indices]  # known first, each by score
        top, rest = order[:pivot], order[pivot:]
        return rest[rest < pivot], top[top >= pivot] - pivot  # held ids evicted, new ids selected


class SpareKnownLRU(SpareKnown, LRU_EvictionPolicy):
    pass


class SpareKnownLFU(SpareKnown, LFU_EvictionPolicy):
    pass


class SpareKnownDistanceLFU(SpareKnown, DistanceLFU_EvictionPolicy):
    pass


SPARING = {"lru": SpareKnownLRU, "lfu": SpareKnownLFU, "distance_lfu": SpareKnownDistanceLFU}  # eviction → class
