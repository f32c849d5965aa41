"""Planning and applying TorchRec sharding: topology → placement → planner → DistributedModelParallel.

Each table's memory tier and compute kernel come from :mod:`modules.sharding.placement` (GPU memory, UVM
caching, SSD, or host memory on CPU; the embedding optimizer decides between ``fused`` and ``dense``
on CPU, see :mod:`modules.optim.optimizers`). The planner (``EmbeddingShardingPlanner``) receives a
``Topology`` built from the topology config and per-table ``ParameterConstraints`` (allowed sharding
types, that kernel, the cache size) and chooses the sharding types and ranks.

TorchRec's planner does not propose row-wise or column-wise sharding on CPU although both run
there; when a CPU run asks for them (``topology.planner=manual``, or a table forced to one), the
plan is built directly: each table takes its first allowed sharding type, table-wise tables go
greedily to the least-loaded rank (largest first).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, Topology, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import CacheParams, ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from modules.embedding.sparse_arch import field_of
from modules.embedding.ssd_tier.files import file_backed_tables, mark_file_backed
from modules.embedding.table_precision import DATA_TYPE_BYTES, precision_of, table_precision_refusal
from modules.optim.optimizers import OPTIMIZERS, OptimizerSpec, is_fusable
from modules.sharding.comm_precision import dense_allreduce_in
from modules.sharding.file_backed_init import drawn_later
from modules.sharding.placement import KERNELS, Placement, PlacementError, TableInfo, place_tables
from modules.sharding.plan_checks import unrunnable
from modules.sharding.step_memory import collection_tables, process_bytes
from modules.sharding.topology import GB, TopologySpec

GBPS_TO_BYTES_PER_MS = 1e9 / 1e3
CPU_UNPLANNED = {ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value}


def build_topology(topology: TopologySpec) -> Topology:
    """TorchRec planner topology for a topology run on ``topology.world_size`` ranks (GiB, GB/s)."""

    def gib(v: float | None) -> int | None:
        return int(float(v) * GB) if v else None

    def rate(v: float | None) -> float | None:
        return None if v is None else float(v) * GBPS_TO_BYTES_PER_MS

    bw = topology.bandwidth_gbps
    hardware = HardwareConfig(
        hbm_cap_bytes=gib(topology.hbm_cap_gb), ddr_cap_bytes=gib(topology.ddr_cap_gb),
        ssd_cap_bytes=gib(topology.ssd.cap_gb),
        hbm_mem_bw=rate(bw.hbm), ddr_mem_bw=rate(bw.host_memory), hbm_to_ddr_mem_bw=rate(bw.host_link),
        intra_host_bw=rate(bw.intra_node), inter_host_bw=rate(bw.inter_node), ssd_mem_bw=rate(bw.ssd))
    trainer = TrainerConfig(world_size=topology.world_size, local_world_size=topology.ranks_per_node or 1)
    return TopologyFactory.create_topology(trainer_config=trainer, hardware_config=hardware,
                                           kernel_config=KernelConfig(compute_device=topology.compute_device))


Collection = EmbeddingBagCollection | EmbeddingCollection
SHARDERS = (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder)


def table_infos(ebc: Collection, coverage: Mapping[str, Mapping[float, int]] | None = None,
                table_of: Mapping[str, str] | None = None) -> list[TableInfo]:
    """Tables of a collection with the id-coverage statistics (per embedding table, multi-hot occurrences
    counted) of the tables they hold rows of (``table_of``: feature → table; default: the feature's own).

    The first-order tables hold the rows of several tables once each: the rows covering a share q of
    their lookups are at most the sum of each table's rows covering q.
    """
    coverage = coverage or {}
    table_of = table_of or {}
    infos = []
    for t in collection_tables(ebc):
        sources = dict.fromkeys(table_of.get(field_of(f), field_of(f)) for f in t.feature_names)
        per_field = [coverage.get(name, {}) for name in sources]
        levels = set.intersection(*(set(c) for c in per_field)) if all(per_field) else set()
        infos.append(TableInfo(t.name, t.num_embeddings, t.embedding_dim,
                               {q: sum(int(c[q]) for c in per_field) for q in sorted(levels)}, len(t.feature_names),
                               DATA_TYPE_BYTES[t.data_type]))
    return infos


def table_constraints(placements: Mapping[str, Placement], topology: TopologySpec) -> dict[str, ParameterConstraints]:
    """Per-table planner constraints: the placement's kernel (and cache size), allowed sharding types."""
    out = {}
    for name, p in placements.items():
        forced = topology.table_overrides.get(name)
        types = [forced.sharding_type] if forced is not None and forced.sharding_type else list(topology.sharding_types)
        if p.kernel == EmbeddingComputeKernel.DENSE.value:
            types = [ShardingType.DATA_PARALLEL.value]
        elif ShardingType.DATA_PARALLEL.value in types and len(types) > 1:
            types = [t for t in types if t != ShardingType.DATA_PARALLEL.value]  # fused kernels are model-parallel
        cache = CacheParams(load_factor=p.cache_load_factor) if p.cache_load_factor else None
        out[name] = ParameterConstraints(sharding_types=types, compute_kernels=[p.kernel], cache_params=cache)
    return out


def manual_plan(ebcs: dict[str, Collection], constraints: Mapping[str, ParameterConstraints],
                topology: TopologySpec) -> ShardingPlan:
    """A plan without the planner: first allowed sharding type per table, greedy table-wise placement."""
    world_size, local_world_size = topology.world_size, topology.ranks_per_node or 1
    load = [0] * world_size
    plans = {}
    for path, ebc in ebcs.items():
        per_param = {}
        for cfg in sorted(collection_tables(ebc), key=lambda c: -c.num_embeddings * c.embedding_dim):
            c = constraints[cfg.name]
            st, kernel = c.sharding_types[0], c.compute_kernels[0]
            if st == ShardingType.TABLE_WISE.value:
                rank = min(range(world_size), key=load.__getitem__)
                load[rank] += cfg.num_embeddings * cfg.embedding_dim
                per_param[cfg.name] = table_wise(rank=rank, compute_kernel=kernel)
            elif st == ShardingType.ROW_WISE.value:
                per_param[cfg.name] = row_wise(compute_kernel=kernel)
            elif st == ShardingType.COLUMN_WISE.value:
                n = max(1, min(world_size, cfg.embedding_dim // 4))
                per_param[cfg.name] = column_wise(ranks=list(range(n)), compute_kernel=kernel)
            elif st == ShardingType.DATA_PARALLEL.value:
                per_param[cfg.name] = data_parallel()
            else:
                raise ValueError(f"table {cfg.name}: sharding type {st!r} is not supported by the manual plan")
        plans[path] = construct_module_sharding_plan(ebc, per_param, local_size=local_world_size,
                                                     world_size=world_size, device_type=topology.compute_device)
    return ShardingPlan(plan=plans)


@contextlib.contextmanager
def planner_sees_optimizer(ebcs: Mapping[str, Collection], optimizer: str) -> Iterator[None]:
    """Let the planner's storage estimates include the embedding optimizer's state, while planning only.

    The estimator reads the optimizer class from the tensor attribute ``apply_optimizer_in_backward``
    sets; without it (``python -m pipeline.commands.plan``, data-parallel Adam on CPU) it counts weights only.

    Tables that already carry an in-backward optimizer (:func:`shard_model`) are left as they are.
    """
    weights = [p for ebc in ebcs.values() for p in ebc.parameters() if not hasattr(p, "_optimizer_classes")]
    cls = OPTIMIZERS[optimizer]
    for w in weights:
        w._optimizer_classes = [cls]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for w in weights:
            del w._optimizer_classes  # type: ignore[attr-defined]


@dataclass
class PlanResult:
    plan: ShardingPlan
    placements: dict[str, Placement]
    planner: EmbeddingShardingPlanner | None  # None for a manual plan

    @property
    def file_backed(self) -> set[str]:
        return file_backed_names(self.placements)


def file_backed_names(placements: Mapping[str, Placement]) -> set[str]:
    """Tables on the CPU ``ssd`` tier (:mod:`modules.embedding.ssd_tier.files`): ``ssd`` with a CPU kernel, not ``key_value``."""
    return {p.table for p in placements.values() if p.tier == "ssd" and p.kernel != KERNELS["ssd"]}


def plan_model(model: nn.Module, embedding_optim: OptimizerSpec, topology: TopologySpec,
               coverage: Mapping[str, Mapping[float, int]] | None = None,
               collective: bool | dist.ProcessGroup = False,
               table_of: Mapping[str, str] | None = None, batch_rows: int = 0, eval_rows: int = 0,
               row_state_bytes: int = 0) -> PlanResult:
    """Place every table on a tier and plan its sharding over ``topology.world_size`` ranks (a topology
    :meth:`~modules.sharding.placement.TopologySpec.for_world`); ``collective`` plans on rank 0 (of all ranks, or
    of the process group given) and broadcasts.
    ``batch_rows`` / ``eval_rows``: the samples one kernel sees at once in a training / evaluation step
    (the larger sizes the ``ssd`` tier's row caches; both the step's working set); ``row_state_bytes``: host
    memory per table row kept beside the tables (:func:`modules.sharding.placement.place_tables`)."""
    ebcs = {name: m for name, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))}
    fusable = is_fusable(embedding_optim, topology.compute_device)
    placements: dict[str, Placement] = {}
    process = process_bytes(model, batch_rows, topology.world_size, eval_rows)
    for ebc in ebcs.values():
        placements.update(place_tables(table_infos(ebc, coverage, table_of), topology, embedding_optim.name, fusable,
                                       process, max(batch_rows, eval_rows), row_state_bytes))
    refused = table_precision_refusal(precision_of([c for m in ebcs.values() for c in collection_tables(m)]),
                                      topology.compute_device, embedding_optim.name, fusable,
                                      sorted(file_backed_names(placements)))
    if refused:
        raise PlacementError(refused)
    constraints = table_constraints(placements, topology)
    forced_unplanned = any(c.sharding_types[0] in CPU_UNPLANNED for c in constraints.values())
    # on CPU the planner would count file-backed tables against host memory: those plans are built here
    on_disk = file_backed_names(placements)
    if topology.planner == "manual" or (topology.compute_device == "cpu" and (forced_unplanned or on_disk)):
        plan = manual_plan(ebcs, constraints, topology)
        mark_file_backed(plan, on_disk)
        return PlanResult(plan, placements, None)
    planner = EmbeddingShardingPlanner(topology=build_topology(topology), constraints=constraints)
    sharders = [cls() for cls in SHARDERS]
    with planner_sees_optimizer(ebcs, embedding_optim.name):
        group = collective if isinstance(collective, dist.ProcessGroup) else dist.GroupMember.WORLD
        plan = planner.collective_plan(model, sharders, group) if collective \
            else planner.plan(model, sharders)
    return PlanResult(plan, placements, planner)


def without_fbgemm_bounds_check(plan: ShardingPlan) -> None:
    """No FBGEMM bounds check for the fused CPU kernels of ``plan``: the model checks every id against its
    table once per batch before the lookups (:func:`modules.embedding.lookup_inputs.check_ids`), vectorised, where
    FBGEMM's CPU check is a serial loop (1.8 ms of DeepFM's step at batch 8,192, docs/throughput.md)."""
    for module_plan in plan.plan.values():
        for sharding in module_plan.values():  # type: ignore[union-attr]
            if sharding.compute_kernel == EmbeddingComputeKernel.FUSED.value:
                sharding.bounds_check_mode = BoundsCheckMode.NONE


def placed_on_global_rank(plan: ShardingPlan, group: dist.ProcessGroup, device: torch.device) -> None:
    """A plan over ``group`` (one rank's own, or one node's ranks): its shards' placements name the members' global
    numbers, which the sharded tensors check against the group's members (the plan's ``ranks`` stay the group's)."""
    for module_plan in plan.plan.values():
        for sharding in module_plan.values():  # type: ignore[union-attr]
            for shard in sharding.sharding_spec.shards if sharding.sharding_spec else ():
                member = shard.placement.rank()  # type: ignore[union-attr]
                shard.placement = torch.distributed._remote_device(
                    f"rank:{dist.get_global_rank(group, member)}/{device}")


class DeviceOnlyWrapper(DataParallelWrapper):
    """Replicated modules without DDP: only the move to the device that DDP's wrapper also makes.

    For one process (no gradient to all-reduce: DDP's bucket copies and hooks would be pure overhead)
    and for k-step merging (the merger averages the replicated parameters itself).
    """

    def wrap(self, dmp: DistributedModelParallel, env: Any, device: torch.device) -> None:
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)


def shard_model(model: nn.Module, embedding_optim: OptimizerSpec, topology: TopologySpec,
                device: torch.device, data_parallel: bool = True, qcomm: dict | None = None,
                coverage: Mapping[str, Mapping[float, int]] | None = None,
                table_of: Mapping[str, str] | None = None,
                batch_rows: int = 0, eval_rows: int = 0, group: dist.ProcessGroup | None = None,
                row_state_bytes: int = 0, dense_precision: str = "fp32") -> tuple[DistributedModelParallel, PlanResult]:
    """Attach the fused embedding optimizer, plan, and wrap ``model`` in DistributedModelParallel.

    ``model``'s embedding collections should be on the meta device: DMP materialises each shard on
    its rank only. ``topology`` is planned for the process group's world size (its ``ranks_per_node``
    when set, else all ranks on one node). The replicated parameters go into DDP when there is more
    than one rank and ``data_parallel`` is set; ``data_parallel=False`` leaves them out (for k-step
    merging, :mod:`modules.optim.kstep_merging`). ``qcomm``: TorchRec's quantized-comms codecs for the
    embedding all-to-alls (:func:`modules.sharding.comm_precision.qcomm_registry`; None: fp32). ``group``: shard
    over this process group instead of all ranks (one rank's own, or its node's: a copy of every table on every
    rank or node, :mod:`modules.sharding.replicated_tables`; DDP, if any, then spans that group, all-reducing in
    ``dense_precision``: :func:`modules.sharding.comm_precision.dense_allreduce_in`).
    """
    ebcs = [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    if is_fusable(embedding_optim, device.type):
        for ebc in ebcs:
            apply_optimizer_in_backward(OPTIMIZERS[embedding_optim.name], ebc.parameters(),
                                        embedding_optim.fused_kwargs())
    world = dist.get_world_size(group)
    topology = topology.on_ranks(world)
    result = plan_model(model, embedding_optim, topology, coverage, collective=group or True, table_of=table_of,
                        batch_rows=batch_rows * world, eval_rows=eval_rows * world,  # table-wise kernels: every rank's batch
                        row_state_bytes=row_state_bytes)
    why = unrunnable(result.placements, result.file_backed, copies=group is not None)
    if why:
        raise PlacementError(why)
    if group is not None:
        placed_on_global_rank(result.plan, group, device)
    if device.type == "cpu":
        without_fbgemm_bounds_check(result.plan)
    wrapper = None if data_parallel and world > 1 else DeviceOnlyWrapper()
    env = ShardingEnv.from_process_group(group) if group is not None else None
    with drawn_later(ebcs, result.file_backed, result.placements) as cached, \
            file_backed_tables(cached, topology.ssd.path or "", dist.get_rank(), topology.ssd.cache_policy):
        dmp = DistributedModelParallel(model, env=env, device=device, plan=result.plan,
                                       sharders=[cls(qcomm_codecs_registry=qcomm) for cls in SHARDERS],
                                       data_parallel_wrapper=wrapper)
    dense_allreduce_in(dmp, dense_precision)
    return dmp, result
