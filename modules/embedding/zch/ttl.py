"""``model.zch.eviction=ttl``: a TTL in the data's own time as a TorchRec MCH eviction policy (:mod:`modules.embedding.zch.remapper`).

The clock (``model.zch.ttl_clock``) is the data's, never the wall's: ``day`` — the store's day index (0, or the
day ``ctr daily`` continues + 1), ``ttl = ttl_days``; ``time`` — the latest row time trained so far, in seconds
(``data.time``), ``ttl = ttl_days · 86,400``. Metadata per held id: ``last`` = the clock's stamp when it was last
seen (stamp = clock + 1, so 0 marks an empty row). At an admission round stamped ``now`` the ids of the round are
stamped, then TorchRec's MCH keeps the ``zch_size`` highest scores:

* a held id unexpired (``now − last < ttl``): +∞ — it keeps its row;
* a held id expired, or an empty row: ``last − 1 − 2·⌈ttl⌉`` (older first, every one below any new id);
* a new id: ``now``;

so a new id takes only an empty or expired row, as HashZch's TTL lets an id probe for an empty or expired slot
(TorchRec ``HashZchManagedCollisionModule``, ``eviction_policy_name=SINGLE_TTL_EVICTION``, which counts hours of
wall time; here the clock is the data's, so replaying last month's logs evicts as production would).
"""

from __future__ import annotations

import math

import torch
from torchrec.modules.mc_modules import MCHEvictionPolicy, MCHEvictionPolicyMetadataInfo

SECONDS_A_DAY = 86_400


class TTLPolicy(MCHEvictionPolicy):
    """TTL in the data's time (module docstring): ``ttl`` in the clock's units; :attr:`now`, the stamp of the
    next round (clock + 1), is set by :class:`modules.embedding.zch.remapper.ZchRemapper`."""

    def __init__(self, ttl: float) -> None:
        super().__init__([MCHEvictionPolicyMetadataInfo("last_day", True, False)])
        self.ttl = ttl
        self.now = 1

    @property
    def metadata_info(self) -> list[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    def record_history_metadata(self, current_iter: int, incoming_ids: torch.Tensor,
                                history_metadata: dict[str, torch.Tensor]) -> None:
        pass  # every id of a round is stamped with the round's clock

    def coalesce_history_metadata(self, current_iter: int, history_metadata: dict[str, torch.Tensor],
                                  unique_ids_counts: torch.Tensor, unique_inverse_mapping: torch.Tensor,
                                  additional_ids: torch.Tensor | None = None,
                                  threshold_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {}

    def update_metadata_and_generate_eviction_scores(
            self, current_iter: int, mch_size: int, coalesced_history_argsort_mapping: torch.Tensor,
            coalesced_history_sorted_unique_ids_counts: torch.Tensor,
            coalesced_history_mch_matching_elements_mask: torch.Tensor,
            coalesced_history_mch_matching_indices: torch.Tensor, mch_metadata: dict[str, torch.Tensor],
            coalesced_history_metadata: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        last = mch_metadata["last_day"]
        stamp = self.now
        last[coalesced_history_mch_matching_indices] = stamp
        new = int((~coalesced_history_mch_matching_elements_mask).sum())
        held = torch.where((last > 0) & (stamp - last < self.ttl), torch.iinfo(torch.int64).max,
                           last - 1 - 2 * math.ceil(self.ttl))
        held[mch_size - 1] = torch.iinfo(torch.int64).max  # the sentinel row of unmatched ids (TorchRec's MCH)
        scores = torch.cat([held, torch.full((new,), stamp, dtype=torch.int64, device="cpu")])
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(mch_size, scores)
        last[evicted] = stamp
        return evicted, selected
