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

With ``model.zch.buckets = B`` each table is B such modules, one per bucket of ids, each over N/B rows and
with its own admission and probation list; each lives on one rank, which maps the ids of every rank's batch
(:mod:`modules.embedding.zch.exchange`: the mapping is split over the ranks). Bucket b's rows are
FIRST_ROW + b·N/B … FIRST_ROW + (b + 1)·N/B − 1; the last of them is its module's row of unmatched ids: unused for
b < B − 1, the table's unknown row for the last bucket (so N − B ids hold rows at most).

Between rounds the ids of the steps are kept (:meth:`get_extra_state`), so a checkpoint taken at any step
resumes exactly. Why not ``HashZchManagedCollisionModule`` (multi-probe ZCH): fbgemm-gpu-cpu 1.9.0's
``zero_collision_hash`` CPU kernel is read-only ("Expected readonly to be true"), so it cannot insert ids
while training on a CPU; MCH is pure PyTorch.
"""

from __future__ import annotations

from typing import Any

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

from modules.embedding.feature_spec import FeatureSpec
from modules.embedding.zch.admission import ProbationAdmission
from modules.embedding.zch.config import FIRST_ROW, MISSING_ROW, ZchConfig
from modules.embedding.zch.exchange import Exchange, bucket_of
from modules.embedding.zch.ttl import SECONDS_A_DAY, TTLPolicy

ADMISSION_PREFIX = "admission."
HELD, ROWS = "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"  # TorchRec MCH buffers: ids held (sorted), their rows
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
    ``table_sizes``: rows of each table (:meth:`ZchConfig.table_sizes`). On several ranks, this rank's modules are
    those of the units it owns (:mod:`modules.embedding.zch.exchange`)."""

    def __init__(self, cfg: ZchConfig, features: dict[str, list[str]], table_sizes: dict[str, int]) -> None:
        super().__init__()
        self.interval, self.buckets = cfg.eviction_interval, cfg.buckets
        self.features = {t: list(f) for t, f in features.items()}
        self.table_of = {k: t for t, keys in self.features.items() for k in keys}
        # units: (table, bucket, name, rows); bucket b's output rows start at FIRST_ROW + b · rows
        self.units = [(t, b, unit_name(t, b, cfg.buckets), (table_sizes[t] - FIRST_ROW) // cfg.buckets)
                      for t in features for b in range(cfg.buckets)]
        self.exchange = Exchange([u[3] for u in self.units])
        mine = [self.units[u] for u in self.exchange.mine]
        self.policies = {name: _policy(cfg) for _, _, name, _ in mine}
        self.clock_from_time = cfg.eviction == "ttl" and cfg.ttl_clock == "time"
        self.latest = -1  # the latest row time trained so far (ttl_clock=time)
        # each module's last output row is MCH's row of unmatched ids (unused: held_rows maps them to the unknown row)
        self.mch = nn.ModuleDict({name: MCHManagedCollisionModule(
            zch_size=n, device=torch.device("cpu"), eviction_policy=self.policies[name], eviction_interval=1,
            output_global_offset=FIRST_ROW + b * n, name=name) for t, b, name, n in mine})
        self.unknown_row = {t: table_sizes[t] - 1 for t in features}
        self.admission = nn.ModuleDict({name: ProbationAdmission(cfg.min_count, int(cfg.probation * n))
                                        for _, _, name, n in mine}) if cfg.min_count > 1 else None
        self.pending: dict[str, list[torch.Tensor]] = {name: [] for _, _, name, _ in mine}
        self.pending_steps = 0
        self.rounds = 0  # admission rounds run (the first ones come sooner: module docstring)
        self.evicted: dict[str, torch.Tensor] = {}
        self.counts = {t: dict.fromkeys(COUNTS, 0) for t in features}

    @classmethod
    def of(cls, cfg: ZchConfig, spec: FeatureSpec) -> "ZchRemapper":
        """The remapper of a model's features (``spec``: each feature's table, the tables' sizes)."""
        features: dict[str, list[str]] = {}
        for f in spec.sparse:
            features.setdefault(spec.table_of(f), []).append(f)
        return cls(cfg, features, spec.table_sizes)

    def set_day(self, day: int) -> None:
        """The data's day (``eviction=ttl``, ``ttl_clock=day``): the store's day index (0, or the base's day + 1)."""
        for policy in self.policies.values():
            if isinstance(policy, TTLPolicy) and not self.clock_from_time:
                policy.now = int(day) + 1

    @torch.no_grad()
    def forward(self, kjt: KeyedJaggedTensor, time: int = -1) -> KeyedJaggedTensor:
        """The batch's raw ids as rows (int64), keys and lengths unchanged. Training: the ids join the next
        admission round, which runs first when this step completes its interval; ``time``: the batch's latest
        row time (``ttl_clock=time``). Every rank calls it at every step (the ids go to their units' ranks)."""
        values = kjt.values().to(torch.int64)
        per_key = dict(zip(kjt.keys(), torch.split(values, kjt.length_per_key())))
        per_table = {t: torch.cat([per_key[k] for k in keys]) for t, keys in self.features.items()}
        sent, places = self._by_unit(per_table)
        received, latest = self.exchange.to_owners(sent, time)
        if self.training:
            self.latest = max(self.latest, latest)
            for u, ids in zip(self.exchange.mine, received):
                self.pending[self.units[u][2]].append(ids[ids != 0])
            self.pending_steps += 1
            if self.pending_steps >= min(self.interval, 1 << self.rounds):
                self._admit()
        rows = []
        for u, ids in zip(self.exchange.mine, received):
            t, name = self.units[u][0], self.units[u][2]
            rows.append(self._remap(name, ids))
            present = ids != 0
            self.counts[t]["unknown"] += int(((rows[-1] == self.unknown_row[t]) & present).sum())
            self.counts[t]["looked_up"] += int(present.sum())
        back, of_key = iter(self.exchange.back(rows)), {}
        for t, keys in self.features.items():
            of_key.update(zip(keys, torch.split(self._in_order(len(per_table[t]), places[t], back),
                                                [len(per_key[k]) for k in keys])))
        out = torch.cat([of_key[k] for k in kjt.keys()]) if kjt.keys() else values.clone()
        out[values == 0] = MISSING_ROW
        return KeyedJaggedTensor(keys=kjt.keys(), values=out, lengths=kjt.lengths(), stride=kjt.stride(),
                                 length_per_key=kjt.length_per_key(), offset_per_key=kjt.offset_per_key())

    def _by_unit(self, per_table: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
        """Every unit's ids of ``per_table`` (units in order), and per table the order that groups its ids by bucket
        (None with one bucket)."""
        sent, places = [], {}
        for t, ids in per_table.items():
            if self.buckets == 1:
                sent.append(ids)
                places[t] = None
                continue
            bucket = bucket_of(ids, self.buckets)
            order = torch.argsort(bucket, stable=True)
            sent.extend(torch.split(ids[order], torch.bincount(bucket, minlength=self.buckets).tolist()))
            places[t] = order
        return sent, places

    def _in_order(self, n: int, order: torch.Tensor | None, back: Any) -> torch.Tensor:
        """A table's rows in the order of its ids, from its units' rows (``back``: the units' rows in order)."""
        if order is None:
            return next(back)
        out = torch.empty(n, dtype=torch.int64, device="cpu")
        out[order] = torch.cat([next(back) for _ in range(self.buckets)])
        return out

    def _remap(self, name: str, raw: torch.Tensor) -> torch.Tensor:
        module = self.mch[name]
        return held_rows(getattr(module, HELD), getattr(module, ROWS), self.unknown_row[self.table_of_unit(name)], raw)

    def table_of_unit(self, name: str) -> str:
        """The table of a unit (a table, or ``<table>@<bucket>``)."""
        return name.split(BUCKET_MARK)[0]

    def _admit(self) -> None:
        for name, parts in self.pending.items():
            ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device="cpu")
            parts.clear()
            if self.clock_from_time:
                if self.latest < 0:
                    raise ValueError("model.zch.ttl_clock=time: the training batches carry no row times (data.time)")
                self.policies[name].now = self.latest + 1
            new = self._admitted(name, ids) if self.admission is not None else None
            if new is not None:
                ids = new[0]
            if len(ids):
                self._profile(name, ids)
            if new is not None:  # new ids that took a row leave probation
                self.admission[name].forget(new[1][self._remap(name, new[1]) != self.unknown_row[self.table_of_unit(name)]])
                self.admission[name].trim()
        if self.exchange.world > 1:  # every rank resets the rows it holds
            mine, self.evicted = self.evicted, {}
            for part in self.exchange.everyone(mine):
                for t, rows in part.items():
                    self.evicted[t] = rows if t not in self.evicted else torch.unique(torch.cat([self.evicted[t], rows]))
        self.pending_steps = 0
        self.rounds += 1

    def _profile(self, name: str, ids: torch.Tensor) -> None:
        """One admission round of a unit over its round's ``ids`` (TorchRec's profile and evict)."""
        module, t = self.mch[name], self.table_of_unit(name)
        if module._input_history_buffer_size < len(ids):
            # TorchRec sizes the history buffer at its first call (1.25 × that call's ids) and drops what
            # overflows it later; rounds differ in size (the first ones come sooner): let it size anew (at
            # eviction_interval 1 it is empty between calls)
            module._input_history_buffer_size = -1
        free_before = int(module.open_slots())
        module.profile({name: JaggedTensor(values=ids, lengths=torch.ones_like(ids))})
        evicted = module.evict()
        taken = 0 if evicted is None else len(evicted)
        self.counts[t]["admitted"] += taken
        self.counts[t]["evicted"] += taken - (free_before - int(module.open_slots()))  # free rows taken evict nobody
        if evicted is not None and taken:
            self.evicted[t] = evicted if t not in self.evicted else torch.unique(torch.cat([self.evicted[t], evicted]))

    def _admitted(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``min_count``: (the round's ``ids`` without the occurrences of new ids not yet seen ``min_count`` times,
        the unit's new ids of the round that may now take a row — sorted)."""
        distinct, inverse, occurrences = torch.unique(ids, return_inverse=True, return_counts=True)
        is_new = self._remap(name, distinct) == self.unknown_row[self.table_of_unit(name)]
        keep = ~is_new
        keep[is_new] = self.admission[name].admitted(distinct[is_new], occurrences[is_new], self.rounds)
        return ids[keep[inverse]], distinct[is_new & keep]

    def take_evicted(self) -> dict[str, torch.Tensor]:
        """Rows that changed hands since the last call (table → rows): to start afresh."""
        out, self.evicted = self.evicted, {}
        return out

    def take_counts(self) -> dict[str, dict[str, float]]:
        """Per table, since the last call, over every rank: ids admitted, ids evicted (admitted into a held row),
        looked-up ids on the unknown row, looked-up ids (missing values aside); and ``occupancy`` now: the share
        of the table's admission rows that hold an id. Every rank calls it."""
        slots = {t: [0, 0] for t in self.features}  # open, admission rows
        for name, m in self.mch.items():
            slots[self.table_of_unit(name)][0] += int(m.open_slots())
            slots[self.table_of_unit(name)][1] += m.output_size() - 1
        table = torch.tensor([[*(self.counts[t][c] for c in COUNTS), *slots[t]] for t in self.features],
                             dtype=torch.int64, device="cpu")
        table = self.exchange.summed(table).tolist()
        self.counts = {t: dict.fromkeys(COUNTS, 0) for t in self.counts}
        return {t: {**dict(zip(COUNTS, row[:len(COUNTS)])), "occupancy": 1.0 - row[-2] / max(1, row[-1])}
                for t, row in zip(self.features, table)}

    def mapping_bytes(self) -> int:
        """Bytes of this rank's mapping as checkpoints hold it: its units' MCH buffers and probation lists (the
        ids of a round and TorchRec's history buffer aside)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values() if isinstance(t, torch.Tensor))

    def get_extra_state(self) -> dict[str, Any]:
        """The ids waiting for the next admission round (a checkpoint between rounds resumes exactly)."""
        return {"pending_steps": self.pending_steps, "rounds": self.rounds, "latest": self.latest,
                "pending": {u: torch.cat(p) if p else torch.zeros(0, dtype=torch.int64, device="cpu")
                            for u, p in self.pending.items()}}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.pending_steps, self.rounds = int(state["pending_steps"]), int(state["rounds"])
        self.latest = int(state.get("latest", -1))
        self.pending = {u: [state["pending"][u]] if len(state["pending"][u]) else [] for u in self.pending}


BUCKET_MARK = "@"


def unit_name(table: str, bucket: int, buckets: int) -> str:
    """A unit's name (its modules' key): the table's with one bucket, ``<table>@<bucket>`` with more."""
    return table if buckets == 1 else f"{table}{BUCKET_MARK}{bucket}"
