"""Hardware-aware placement of embedding tables on memory tiers, from a topology config.

Tiers and the TorchRec/FBGEMM compute kernels that implement them:

=============  ====================  ==============================================================
tier           kernel                where the table lives
=============  ====================  ==============================================================
``hbm``        ``fused``             GPU memory (the optimizer fused into the backward)
``uvm_cache``  ``fused_uvm_caching``  host memory, with a GPU cache of its hottest rows
``ssd``        ``key_value``          SSD (FBGEMM SSD TBE), with a GPU cache
``host``       ``fused`` / ``dense``  CPU training: host memory
``ssd`` (CPU)  ``fused``              CPU training: files under ``topology.ssd.path``, trained through
                                     a row cache in host memory (:mod:`modules.embedding.ssd_tier.files`)
=============  ====================  ==============================================================

On CPU, the host budget is what the stated memory leaves for tables once the process itself is counted:
``nodes × (ddr_cap_gb × (1 − ddr_reserve) − ranks per node × process)``, *process* being what the planning
process holds (measured, :mod:`modules.sharding.resident_memory`) plus a step's working set (estimated,
:func:`modules.sharding.step_memory.step_bytes`) and any per-row state training keeps beside the tables;
``ddr_reserve`` is left to the page cache. Every table stays in host memory while the tables fit that budget
(weights + optimizer state); otherwise the budget is shared between whole tables in host memory and the
row caches (:mod:`modules.embedding.ssd_tier.row_cache`) of tables on ``ssd`` by the lookups each byte
serves, from the id-frequency statistics (:mod:`modules.sharding.cache_allocation`; tables forced to a tier
in ``table_overrides`` stay there). ``ssd.cache_mb`` sets the caches outright instead (then the largest
tables move until the rest fit). The ``ssd`` budget is ``ssd.cap_gb`` per node, or the free space of
``ssd.path`` when ``cap_gb`` is 0.

Rule (per table, weights + optimizer state): everything goes to GPU memory while it fits the HBM
budget (``hbm_cap_gb`` per GPU × GPUs × (1 − ``hbm_reserve``), the rest left to dense layers and
activations); otherwise the largest tables move to UVM caching, each with a cache that holds the
rows carrying ``cache_coverage`` of the id occurrences (from the id-frequency statistics measured
at preprocessing, or a Zipf model for shape-only data): ``cache_load_factor = rows_cover / rows``.
If the host memory of the nodes (``ddr_cap_gb`` × nodes × (1 − ``ddr_reserve``)) cannot hold the
UVM tables, the largest move to SSD. If the caches alone still overflow GPU memory, they shrink
proportionally (not below ``min_cache_load_factor``). Tables can be forced to a tier in ``table_overrides``. When
nothing fits, :class:`PlacementError` says what is needed and what the topology offers.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from torchrec.distributed.embedding_types import EmbeddingComputeKernel

from modules.embedding.ssd_tier.backing import ROW_INDEX_BYTES, slot_bytes
from modules.embedding.ssd_tier.row_cache import MIN_SLOTS_PER_ID
from modules.sharding.cache_allocation import Claim, allocate, coverage_curve, least_bytes
from modules.sharding.topology import GB, TableOverride, TopologySpec
from modules.zipf import zipf_coverage

KERNELS = {
    "hbm": EmbeddingComputeKernel.FUSED.value,
    "uvm_cache": EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
    "ssd": EmbeddingComputeKernel.KEY_VALUE.value,
    "host": EmbeddingComputeKernel.FUSED.value,
}
TIER_OF_KERNEL = {v: k for k, v in KERNELS.items() if k != "host"}
CPU_TIERS = ("host", "ssd")
DEFAULT_CACHE_MB = 256   # row cache per rank for tables forced to ssd when ddr_cap_gb is not described
MIN_CACHE_ROWS = 1024    # a row cache's least rows when the batch size is not known
UNSEEN_MARGIN = 2        # a batch's distinct rows ≤ this × the training split's (random splits: values new in evaluation)
UNMEASURED_ZIPF_EXPONENT = 1.0  # the ids of a table without statistics (raw ids): Zipf's law, for its cache's share
# extra float32 values per row (per column when the second item is True)
OPTIMIZER_STATE_PER_ROW = {"sgd": (0, False), "adagrad": (1, True), "rowwise_adagrad": (1, False), "adam": (2, True)}


class PlacementError(ValueError):
    """The embedding tables cannot be placed on the topology; the message gives the numbers."""

    hint = "see the plan with ctr plan"


@dataclass(frozen=True)
class TableInfo:
    name: str
    rows: int
    dim: int
    coverage_rows: Mapping[float, int] = field(default_factory=dict)  # share of occurrences → hottest rows
    features: int = 1  # features (KJT keys) reading the table: ids per sample, for one-id features
    value_bytes: int = 4  # a weight's bytes (model.table_precision); the optimizer state stays 4 a value

    def bytes(self, optimizer: str) -> int:
        per, per_col = OPTIMIZER_STATE_PER_ROW.get(optimizer, (2, True))
        return self.rows * (self.value_bytes * self.dim + 4 * (per * self.dim if per_col else per))

    def distinct_rows(self) -> int | None:
        """The rows the training data meets at all (the statistics' share 1.0), if measured."""
        return min(self.rows, int(self.coverage_rows[1.0])) if 1.0 in self.coverage_rows else None

    def rows_covering(self, share: float) -> int:
        if not self.coverage_rows:
            return self.rows
        levels = sorted(self.coverage_rows)
        q = next((x for x in levels if x >= share), levels[-1])
        return min(self.rows, int(self.coverage_rows[q]))


@dataclass(frozen=True)
class Placement:
    table: str
    tier: str
    kernel: str
    bytes: int
    rows: int
    dim: int
    cache_load_factor: float | None = None
    forced: bool = False
    cache_rows: int | None = None  # CPU ssd tier: rows of its row cache in host memory
    cache_share: float | None = None  # … and the share of the table's lookups its rows carry (estimated)

    @property
    def row_bytes(self) -> float:
        return self.bytes / max(1, self.rows)

    @property
    def slot_bytes(self) -> float:
        """A row cache slot (:func:`modules.embedding.ssd_tier.backing.slot_bytes`)."""
        return slot_bytes(self.row_bytes)

    @property
    def cache_bytes(self) -> float:
        """Host memory an ``ssd`` table takes: its row cache, and its index (:data:`ROW_INDEX_BYTES` a row)."""
        return (self.cache_rows or 0) * self.slot_bytes + (self.rows * ROW_INDEX_BYTES if self.tier == "ssd" else 0)

    @property
    def hbm_bytes(self) -> float:
        cached = self.bytes * (self.cache_load_factor or 0.0) if self.tier in ("uvm_cache", "ssd") else 0.0
        return self.bytes if self.tier == "hbm" else cached


def _gb(x: float) -> str: return f"{x / GB:,.1f} GB"  # noqa: E704


def place_tables(tables: Sequence[TableInfo], topology: TopologySpec, optimizer: str,
                 fusable: bool = True, process_bytes: float = 0.0, batch_rows: int = 0,
                 row_state_bytes: int = 0) -> dict[str, Placement]:
    """Choose each table's tier (module docstring); ``process_bytes``: what one training process holds besides
    its tables, ``batch_rows``: the most samples one lookup sees (CPU), ``row_state_bytes``: host memory per
    table row wherever it lives (the every-row L2's last steps: :class:`modules.optim.embedding_l2.LazyRowsL2`)."""
    overrides: Mapping[str, TableOverride] = topology.table_overrides
    unknown = sorted(set(overrides) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"topology.table_overrides: unknown tables {unknown}; tables are {sorted(t.name for t in tables)}")
    row_state = float(row_state_bytes * sum(t.rows for t in tables))
    if topology.compute_device != "cuda":
        process_bytes += row_state / topology.world_size
        return _place_on_cpu(tables, topology, optimizer, fusable, process_bytes, batch_rows)
    hosted = sorted(name for name, o in overrides.items() if o.tier == "host")
    if hosted:
        raise PlacementError(f"topology.table_overrides: {hosted} tier=host is a CPU tier; on a GPU topology the "
                             f"host-memory tier is uvm_cache")
    by_name = {t.name: t for t in tables}

    def cache_lf(t: TableInfo) -> float:
        return min(1.0, max(topology.min_cache_load_factor, t.rows_covering(topology.cache_coverage) / max(1, t.rows)))

    place: dict[str, Placement] = {}
    for t in tables:
        o = overrides.get(t.name) or TableOverride()
        tier = TIER_OF_KERNEL.get(o.compute_kernel, o.tier or "hbm")  # type: ignore[arg-type]
        lf = o.cache_load_factor if o.cache_load_factor is not None else (cache_lf(t) if tier != "hbm" else None)
        place[t.name] = Placement(t.name, tier, KERNELS[tier], t.bytes(optimizer), t.rows, t.dim, lf,
                                  forced=t.name in overrides)

    budget = topology.budgets()
    budget["host"] -= row_state
    use = lambda tier: sum(p.bytes for p in place.values() if p.tier == tier)  # noqa: E731
    hbm_use = lambda: sum(p.hbm_bytes for p in place.values())  # noqa: E731

    def movable(tier: str) -> list[Placement]:
        return sorted((p for p in place.values() if p.tier == tier and not p.forced), key=lambda p: -p.bytes)

    while hbm_use() > budget["hbm"] and movable("hbm"):
        p = movable("hbm")[0]
        place[p.table] = replace(p, tier="uvm_cache", kernel=KERNELS["uvm_cache"],
                                 cache_load_factor=cache_lf(by_name[p.table]))
    while use("uvm_cache") > budget["host"] and movable("uvm_cache"):
        p = movable("uvm_cache")[0]
        place[p.table] = replace(p, tier="ssd", kernel=KERNELS["ssd"])
    cached = [p for p in place.values() if p.tier in ("uvm_cache", "ssd") and not p.forced]
    cache_bytes = sum(p.hbm_bytes for p in cached)
    if hbm_use() > budget["hbm"] and cache_bytes:
        room = budget["hbm"] - (hbm_use() - cache_bytes)
        shrink = max(0.0, room) / cache_bytes
        for p in cached:
            place[p.table] = replace(p, cache_load_factor=max(topology.min_cache_load_factor,
                                                              p.cache_load_factor * shrink))

    needs = {"hbm": hbm_use(), "host": use("uvm_cache"), "ssd": use("ssd")}
    over = [tier for tier in needs if needs[tier] > budget[tier]]
    if over:
        total = sum(t.bytes(optimizer) for t in tables)
        largest = max(tables, key=lambda t: t.bytes(optimizer))
        detail = "; ".join(f"{tier}: needs {_gb(needs[tier])}, has {_gb(budget[tier])}" for tier in needs)
        raise PlacementError(
            f"the embedding tables ({_gb(total)} with {optimizer} state; largest {largest.name} "
            f"{_gb(largest.bytes(optimizer))}) do not fit topology '{topology.name}' "
            f"({topology.nodes} node(s) × {topology.ranks_per_node} GPU(s)): {detail}. "
            f"Use a larger topology, fewer/smaller tables (data.preprocess.min_count, hashing), "
            f"a smaller model.embedding_dim, fp16 rows (model.table_precision) or an optimizer with less state.")
    return place


def cache_floor(t: TableInfo, batch_rows: int) -> int:
    """An ``ssd`` table's least row cache, at most the table: :data:`MIN_SLOTS_PER_ID` slots per distinct row one
    batch can bring, ``min(batch_rows · features, UNSEEN_MARGIN · (distinct training values + 2 · features))`` — a
    hashed table of 1,460 values meets those rows, each feature's missing and OOV rows and an evaluation split's new
    values (the margin), however many ids a batch holds; :data:`MIN_CACHE_ROWS` when the batch size is not known."""
    if not batch_rows:
        return min(t.rows, MIN_CACHE_ROWS)
    distinct, per_batch = t.distinct_rows(), batch_rows * t.features
    if distinct is not None:
        per_batch = min(per_batch, UNSEEN_MARGIN * (distinct + 2 * t.features))
    return min(t.rows, MIN_SLOTS_PER_ID * per_batch)


def _place_on_cpu(tables: Sequence[TableInfo], topology: TopologySpec, optimizer: str,
                  fusable: bool, process_bytes: float, batch_rows: int) -> dict[str, Placement]:
    """CPU tiers: host memory, or files (``ssd``) behind a row cache, by the lookups each byte of the host
    budget serves (:mod:`modules.sharding.cache_allocation`)."""
    kernel = KERNELS["host"] if fusable else EmbeddingComputeKernel.DENSE.value
    place: dict[str, Placement] = {}
    for t in tables:
        o = topology.table_overrides.get(t.name) or TableOverride()
        if o.tier is not None and o.tier not in CPU_TIERS:
            raise PlacementError(f"topology.table_overrides.{t.name}.tier={o.tier}: a CPU topology has the tiers "
                                 f"{' and '.join(CPU_TIERS)}")
        place[t.name] = Placement(t.name, o.tier or "host", o.compute_kernel or kernel, t.bytes(optimizer), t.rows,
                                  t.dim, forced=o.tier is not None)
    budget = topology.budgets()
    # host memory not described: nothing moves on its own
    budget["host"] = budget["host"] - topology.world_size * process_bytes if topology.ddr_cap_gb > 0 else math.inf
    use = lambda tier: sum(p.bytes for p in place.values() if p.tier == tier)  # noqa: E731
    floors = {t.name: cache_floor(t, batch_rows) for t in tables}
    claims = {t.name: Claim(t.name, t.rows, float(t.features),
                            coverage_curve(t.rows, t.coverage_rows or zipf_coverage(t.rows, UNMEASURED_ZIPF_EXPONENT)),
                            place[t.name].row_bytes, place[t.name].slot_bytes, t.rows * ROW_INDEX_BYTES, floors[t.name],
                            may_host=not (place[t.name].forced and place[t.name].tier == "ssd")) for t in tables}
    movable = [claims[p.table] for p in place.values() if not p.forced]
    fixed = [claims[p.table] for p in place.values() if p.forced and p.tier == "ssd"]
    room = budget["host"] - sum(p.bytes for p in place.values() if p.forced and p.tier == "host")
    if topology.ssd.cache_mb is not None:  # a cache set outright is not taken from the budget: the largest
        # tables move until the rest fit
        while use("host") > budget["host"] and any(p.tier == "host" and not p.forced for p in place.values()):
            p = max((p for p in place.values() if p.tier == "host" and not p.forced), key=lambda p: p.bytes)
            place[p.table] = replace(p, tier="ssd")
    elif sum(c.host_bytes for c in movable) + least_bytes(fixed) > room and movable:
        least = least_bytes(movable + fixed)  # below: room < 0 (forced host tables overflow) and not fusable
        if fusable and 0 <= room < least:
            raise PlacementError(
                f"the tables get no row cache: they need {least / 2**20:,.1f} MB at least (each "
                f"whole or behind a cache of the rows one batch can bring × {MIN_SLOTS_PER_ID}, whichever is smaller); "
                f"topology.ddr_cap_gb={topology.ddr_cap_gb:g} × (1 − ddr_reserve) leaves {max(0.0, room) / 2**20:,.0f} "
                f"MB after tables forced to host and this process's own {process_bytes / 2**20:,.0f} MB per rank. Raise "
                f"topology.ddr_cap_gb, or set the cache outright with topology.ssd.cache_mb=<MB per rank>")
        chosen = allocate(movable + fixed, room)
        place.update({c.name: replace(place[c.name], tier="host" if chosen[c.name] is None else "ssd") for c in movable})
    on_disk = sorted(p.table for p in place.values() if p.tier == "ssd")
    if on_disk and not fusable:
        raise PlacementError(f"tables {on_disk} need tier ssd, which runs FBGEMM's fused sgd, adagrad or "
                             f"rowwise_adagrad; optim.embedding.name={optimizer} keeps every table in memory")
    if on_disk and not topology.ssd.path:
        raise PlacementError(f"tables {on_disk} need tier ssd ({_gb(use('ssd'))}): set topology.ssd.path=<a folder "
                             f"on a local disk> (the host budget is {_gb(budget['host'])}: topology.ddr_cap_gb × "
                             f"(1 − ddr_reserve))")
    ssd_budget = budget["ssd"] or (topology.nodes * shutil.disk_usage(_existing(topology.ssd.path)).free
                                   if on_disk else 0.0)
    needs = {"host": use("host"), "ssd": use("ssd")}
    over = [tier for tier in needs if needs[tier] > (max(0.0, budget["host"]) if tier == "host" else ssd_budget)]
    if over:
        raise PlacementError(f"the embedding tables do not fit topology '{topology.name}': host needs "
                             f"{_gb(needs['host'])} of {_gb(budget['host'])} (tables forced there), ssd needs "
                             f"{_gb(needs['ssd'])} of {_gb(ssd_budget)}. Raise topology.ddr_cap_gb or "
                             f"topology.ssd.cap_gb, or use smaller tables")
    index = sum(p.rows * ROW_INDEX_BYTES for p in place.values() if p.tier == "ssd")
    return _row_caches(place, topology, budget["host"] - use("host") - index, claims)


def _row_caches(place: dict[str, Placement], topology: TopologySpec, left: float,
                claims: Mapping[str, Claim]) -> dict[str, Placement]:
    """Each ``ssd`` table's row cache: at least its floor (the distinct ids one batch can bring, ×
    :data:`MIN_SLOTS_PER_ID`: :mod:`modules.embedding.ssd_tier.row_cache`), then ``left`` bytes (or ``ssd.cache_mb``
    per rank) beyond the index shared by lookups served per byte (:func:`allocate`); at most the whole table."""
    on_disk = [replace(claims[p.table], may_host=False, index_bytes=0.0) for p in place.values() if p.tier == "ssd"]
    if not on_disk:
        return place
    if topology.ssd.cache_mb is not None:
        left = topology.ssd.cache_mb * 2**20 * topology.world_size
    elif math.isinf(left):  # host memory not described: tables forced to ssd get the default cache
        left = DEFAULT_CACHE_MB * 2**20 * topology.world_size
    need = least_bytes(on_disk)
    if need > left:
        given = (f"topology.ssd.cache_mb={topology.ssd.cache_mb:g}" if topology.ssd.cache_mb is not None else
                 f"what the host tables leave, {max(0.0, left) / 2**20:,.0f} MB,")
        raise PlacementError(f"{given} cannot give the {len(on_disk)} ssd tables their row caches, {need / 2**20:,.1f} "
                             f"MB for the rows one batch can bring (× {MIN_SLOTS_PER_ID}); raise topology.ssd.cache_mb "
                             f"or lower the batch size")
    rows = allocate(on_disk, left)
    return {name: replace(p, cache_rows=rows[name], cache_share=claims[name].share(rows[name] or 0))
            if name in rows else p for name, p in place.items()}


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (the disk it will be on)."""
    p = os.path.abspath(path)
    return p if os.path.exists(p) else _existing(os.path.dirname(p))
