"""Zero-collision mapping of 64-bit feature ids to table rows, with eviction: TorchRec's managed-collision
module ``MCHManagedCollisionModule`` in front of every table (``model.zch``).

A raw store (``data.preprocess.categorical: raw``) holds for every value a 63-bit id of (table, value)
(:func:`pipeline.data.encoding.raw_ids`; 0 = missing); there is no vocabulary. With ``model.zch.rows = N``
(per table: ``model.zch.tables``) a table has ``N + 2`` rows:

* row 1: missing values (id 0), as with vocabularies; row 0 (a vocabulary's OOV) is unused;
* rows 2 … N: the ids admitted, one row each — no two ids share a row;
* row N + 1: every id not admitted: new ids until the next admission, ids the policy turned away, and at
  serving time ids never met in training (:meth:`ZchRemapper.forward` counts them).

Admission (TorchRec's MCH algorithm, one round after training steps 1, 2, 4, … up to every ``eviction_interval``
steps, so that a fresh table fills at once): the ids of the
steps since the last round are counted (``torch.unique``); held ids update their metadata; the N − 1 ids
with the best scores among held and new ones keep or take a row — free rows first, so the mapping is
collision-free while there is room — and the rows of the ids that lose theirs are returned
(:meth:`ZchRemapper.take_evicted`) to start afresh: weights drawn as at initialisation, optimizer state
zero (:mod:`modules.embedding.row_reset`). Scores (``model.zch.eviction``):

* ``lru``: ``−(t − last seen + 1)``, t counted in admission rounds (TorchRec's ``LRU_EvictionPolicy``);
* ``lfu``: occurrences since admission (TorchRec's ``LFU_EvictionPolicy``);
* ``distance_lfu``: occurrences since admission / (rounds since last seen + 1) (TorchRec's
  ``DistanceLFU_EvictionPolicy``, decay exponent 1): frequent ids keep their rows, but not forever once unseen;
* ``ttl``: in the data's own time (:class:`modules.embedding.zch.ttl.TTLPolicy`; ``ttl_clock``: the store's day,
  or the latest row time trained, ``data.time``): a held id unseen for less than ``ttl_days`` days keeps its row;
  an expired one gives it up to a new id (newest first). Replaying last month's logs evicts as production would.

Between rounds the ids of the steps are kept (:meth:`get_extra_state`), so a checkpoint taken at any step
resumes exactly. Why not ``HashZchManagedCollisionModule`` (multi-probe ZCH): fbgemm-gpu-cpu 1.9.0's
``zero_collision_hash`` CPU kernel is read-only ("Expected readonly to be true"), so it cannot insert ids
while training on a CPU; MCH is pure PyTorch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec import JaggedTensor, KeyedJaggedTensor
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)

from modules.embedding.zch.admission import ProbationAdmission
from modules.embedding.zch.config import FIRST_ROW, MISSING_ROW, ZchConfig
from modules.embedding.zch.global_batch import global_ids
from modules.embedding.zch.ttl import SECONDS_A_DAY, TTLPolicy

ADMISSION_PREFIX = "admission."
COUNTS = ("admitted", "evicted", "unknown", "looked_up")  # per table, since the last take_counts


def _policy(cfg: ZchConfig) -> MCHEvictionPolicy:
    if cfg.eviction == "lru":
        return LRU_EvictionPolicy()
    if cfg.eviction == "lfu":
        return LFU_EvictionPolicy()
    if cfg.eviction == "distance_lfu":
        return DistanceLFU_EvictionPolicy(decay_exponent=1.0)
    return TTLPolicy(cfg.ttl_days * (SECONDS_A_DAY if cfg.ttl_clock == "time" else 1))


def held_rows(held: torch.Tensor, rows: torch.Tensor, unknown_row: int, raw: torch.Tensor) -> torch.Tensor:
    """Rows of ``raw`` ids as TorchRec's MCH remaps them (``_mch_remap``) over its buffers — ``held``: the ids
    held, sorted (the last a sentinel), ``rows``: their rows — a held id → its row, any other → ``unknown_row``;
    one ``torch.where`` instead of its masked writes."""
    at = torch.searchsorted(held[:-1], raw)
    return torch.where(held[at] == raw, rows[at], unknown_row)


class ZchRemapper(nn.Module):
    """Raw ids → rows of each table (module docstring). ``features``: table → the KJT keys that read it;
    ``table_sizes``: rows of each table (:meth:`ZchConfig.table_sizes`)."""

    def __init__(self, cfg: ZchConfig, features: dict[str, list[str]], table_sizes: dict[str, int]) -> None:
        super().__init__()
        self.interval = cfg.eviction_interval
        self.features = {t: list(f) for t, f in features.items()}
        self.table_of = {k: t for t, keys in self.features.items() for k in keys}
        self.policies = {t: _policy(cfg) for t in features}
        self.clock_from_time = cfg.eviction == "ttl" and cfg.ttl_clock == "time"
        self.latest = -1  # the latest row time trained so far (ttl_clock=time)
        # output rows FIRST_ROW … FIRST_ROW + rows − 1; the last is MCH's row of unmatched ids
        self.mch = nn.ModuleDict({t: MCHManagedCollisionModule(
            zch_size=table_sizes[t] - FIRST_ROW, device=torch.device("cpu"), eviction_policy=self.policies[t],
            eviction_interval=1, output_global_offset=FIRST_ROW, name=t) for t in features})
        self.unknown_row = {t: table_sizes[t] - 1 for t in features}
        rows = sum(table_sizes[t] - FIRST_ROW for t in features)
        self.admission = ProbationAdmission(cfg.min_count, int(cfg.probation * rows)) if cfg.min_count > 1 else None
        self.pending: dict[str, list[torch.Tensor]] = {t: [] for t in features}
        self.pending_steps = 0
        self.rounds = 0  # admission rounds run (the first ones come sooner: module docstring)
        self.evicted: dict[str, torch.Tensor] = {}
        self.counts = {t: dict.fromkeys(COUNTS, 0) for t in features}

    def set_day(self, day: int) -> None:
        """The data's day (``eviction=ttl``, ``ttl_clock=day``): the store's day index (0, or the base's day + 1)."""
        for policy in self.policies.values():
            if isinstance(policy, TTLPolicy) and not self.clock_from_time:
                policy.now = int(day) + 1

    @torch.no_grad()
    def forward(self, kjt: KeyedJaggedTensor, time: int = -1) -> KeyedJaggedTensor:
        """The batch's raw ids as rows (int64), keys and lengths unchanged. Training: the ids join the next
        admission round, which runs first when this step completes its interval; ``time``: the batch's latest
        row time (``ttl_clock=time``)."""
        values = kjt.values().to(torch.int64)
        per_key = dict(zip(kjt.keys(), torch.split(values, kjt.length_per_key())))
        if self.training:
            step = {t: torch.cat([per_key[k] for k in keys]) for t, keys in self.features.items()}
            step, latest = global_ids(step, time)
            self.latest = max(self.latest, latest)
            for t, ids in step.items():
                self.pending[t].append(ids[ids != 0])
            self.pending_steps += 1
            if self.pending_steps >= min(self.interval, 1 << self.rounds):
                self._admit()
        out = torch.empty_like(values)
        start = 0
        for k, n in zip(kjt.keys(), kjt.length_per_key()):
            t, present = self.table_of[k], per_key[k] != 0
            out[start:start + n] = rows = self._remap(t, per_key[k])
            self.counts[t]["unknown"] += int(((rows == self.unknown_row[t]) & present).sum())
            self.counts[t]["looked_up"] += int(present.sum())
            start += n
        out[values == 0] = MISSING_ROW
        return KeyedJaggedTensor(keys=kjt.keys(), values=out, lengths=kjt.lengths(), stride=kjt.stride(),
                                 length_per_key=kjt.length_per_key(), offset_per_key=kjt.offset_per_key())

    def _remap(self, table: str, raw: torch.Tensor) -> torch.Tensor:
        module = self.mch[table]
        return held_rows(module._mch_sorted_raw_ids, module._mch_remapped_ids_mapping, self.unknown_row[table], raw)

    def _admit(self) -> None:
        round_ids = {t: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64) for t, parts in self.pending.items()}
        for parts in self.pending.values():
            parts.clear()
        if self.clock_from_time:
            if self.latest < 0:
                raise ValueError("model.zch.ttl_clock=time: the training batches carry no row times (data.time)")
            for policy in self.policies.values():
                policy.now = self.latest + 1
        new = self._admitted(round_ids) if self.admission is not None else {}
        for t, ids in round_ids.items():
            if not len(ids):
                continue
            module = self.mch[t]
            if module._input_history_buffer_size < len(ids):
                # TorchRec sizes the history buffer at its first call (1.25 × that call's ids) and drops what
                # overflows it later; rounds differ in size (the first ones come sooner): let it size anew (at
                # eviction_interval 1 it is empty between calls)
                module._input_history_buffer_size = -1
            free_before = int(module.open_slots())
            module.profile({t: JaggedTensor(values=ids, lengths=torch.ones_like(ids))})
            evicted = module.evict()
            taken = 0 if evicted is None else len(evicted)
            self.counts[t]["admitted"] += taken
            self.counts[t]["evicted"] += taken - (free_before - int(module.open_slots()))  # free rows taken evict nobody
            if evicted is not None and taken:
                self.evicted[t] = evicted if t not in self.evicted else torch.unique(torch.cat([self.evicted[t], evicted]))
        if self.admission is not None:  # new ids that took a row leave probation
            entered = [n[self._remap(t, n) != self.unknown_row[t]] for t, n in new.items()]
            self.admission.forget(torch.sort(torch.cat(entered)).values if entered else torch.zeros(0, dtype=torch.int64))
            self.admission.trim()
        self.pending_steps = 0
        self.rounds += 1

    def _admitted(self, round_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``min_count``: drop from ``round_ids`` (in place) the occurrences of new ids not yet seen ``min_count``
        times; every table's new ids go through the probation list at once (the ids are table-salted). Returns
        each table's new ids of the round that may now take a row."""
        per_table = {}
        for t, ids in round_ids.items():
            distinct, inverse, occurrences = torch.unique(ids, return_inverse=True, return_counts=True)
            per_table[t] = (distinct, inverse, occurrences, self._remap(t, distinct) == self.unknown_row[t])
        new = torch.cat([d[m] for d, _, _, m in per_table.values()]) if per_table else torch.zeros(0, dtype=torch.int64)
        order = torch.argsort(new)
        occurrences = torch.cat([o[m] for _, _, o, m in per_table.values()]) if per_table else torch.zeros(0, dtype=torch.int64)
        ok = torch.empty(len(new), dtype=torch.bool)
        ok[order] = self.admission.admitted(new[order], occurrences[order], self.rounds)
        out, start = {}, 0
        for t, (distinct, inverse, _, is_new) in per_table.items():
            keep = ~is_new
            keep[is_new] = ok[start:start + int(is_new.sum())]
            start += int(is_new.sum())
            round_ids[t] = round_ids[t][keep[inverse]]
            out[t] = distinct[is_new][keep[is_new]]
        return out

    def take_evicted(self) -> dict[str, torch.Tensor]:
        """Rows that changed hands since the last call (table → rows): to start afresh."""
        out, self.evicted = self.evicted, {}
        return out

    def occupancy(self) -> dict[str, float]:
        """Share of each table's admission rows that hold an id."""
        return {t: 1.0 - int(m.open_slots()) / max(1, m.output_size() - 1) for t, m in self.mch.items()}

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Per table, since the last call: ids admitted, ids evicted (admitted into a held row), looked-up ids
        on the unknown row, looked-up ids (missing values aside)."""
        out, self.counts = self.counts, {t: dict.fromkeys(COUNTS, 0) for t in self.counts}
        return out

    def get_extra_state(self) -> dict[str, Any]:
        """The ids waiting for the next admission round (a checkpoint between rounds resumes exactly)."""
        return {"pending_steps": self.pending_steps, "rounds": self.rounds, "latest": self.latest,
                "pending": {t: torch.cat(p) if p else torch.zeros(0, dtype=torch.int64) for t, p in self.pending.items()}}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.pending_steps, self.rounds = int(state["pending_steps"]), int(state["rounds"])
        self.latest = int(state.get("latest", -1))
        self.pending = {t: [state["pending"][t]] if len(state["pending"][t]) else [] for t in self.features}


def mapping_state(remapper: ZchRemapper) -> dict[str, np.ndarray]:
    """The mapping of every table: the remapper's state dict without the ids waiting for a round — TorchRec's
    buffers ``mch.<table>.<buffer>`` (ids held, sorted, their rows, the policy's metadata, the round count) and
    the probation list ``admission.ids`` / ``.counts`` / ``.last`` if any. What a model folder keeps to score, and a next day continues from; a
    checkpoint holds the same keys under ``state_dict/zch.remapper.``."""
    return {k: v.numpy().copy() for k, v in remapper.state_dict().items() if isinstance(v, torch.Tensor)}


def load_mapping_state(remapper: ZchRemapper, state: dict[str, np.ndarray] | None) -> None:
    """Continue from :func:`mapping_state` (``trainer.init_from``): same ids on the same rows; the probation list
    where both runs keep one."""
    if not state:
        raise ValueError("trainer.init_from: the source model has no model.zch mapping (it was trained on a "
                         "vocabulary or hashed ids); start this raw-id run afresh")
    result = remapper.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if k.startswith("mch.")]
    unexpected = [k for k in result.unexpected_keys if not k.startswith(ADMISSION_PREFIX)]
    if missing or unexpected:
        raise ValueError(f"trainer.init_from: the source's model.zch mapping does not fit this run's tables "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def lookup_rows(state: dict[str, np.ndarray], table: str, raw: np.ndarray) -> np.ndarray:
    """Read-only remap of raw ids (int64) with a table's :func:`mapping_state`, as training remaps
    (:func:`held_rows`); missing (0) → row 1; the unknown row is the table's last."""
    held = torch.from_numpy(state[f"mch.{table}._mch_sorted_raw_ids"])
    raw = torch.from_numpy(np.asarray(raw, dtype=np.int64))
    out = held_rows(held, torch.from_numpy(state[f"mch.{table}._mch_remapped_ids_mapping"]), FIRST_ROW + len(held) - 1,
                    raw)
    out[raw == 0] = MISSING_ROW
    return out.numpy()
