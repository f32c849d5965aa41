"""Planning and applying TorchRec sharding: topology → planner → DistributedModelParallel.

The planner (``EmbeddingShardingPlanner``) receives a ``Topology`` built from the run's topology
config and per-table ``ParameterConstraints`` (allowed sharding types and compute kernel). The
kernel follows the embedding optimizer: ``fused`` (optimizer in FBGEMM's backward) when the device
has it, otherwise ``dense`` with data-parallel sharding (see :mod:`modules.optimizers`).

TorchRec's planner does not propose row-wise or column-wise sharding on CPU although both run
there; when a CPU run asks for them (``topology.planner=manual``, or a table forced to one), the
plan is built directly: each table takes its first allowed sharding type, table-wise tables go
greedily to the least-loaded rank (largest first).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, Topology, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from modules.optimizers import OPTIMIZERS, OptimizerSpec, is_fusable

GB = 1024**3
SHARDING_TYPES = {t.value for t in ShardingType}


def build_topology(topology: Mapping[str, Any], world_size: int, local_world_size: int) -> Topology:
    """TorchRec planner topology from a ``conf/topology`` entry (capacities in GiB)."""

    def gib(key: str) -> int | None:
        v = topology.get(key)
        return None if v is None else int(float(v) * GB)

    hardware = HardwareConfig(hbm_cap_bytes=gib("hbm_cap_gb"), ddr_cap_bytes=gib("ddr_cap_gb"),
                              ssd_cap_bytes=gib("ssd_cap_gb"))
    trainer = TrainerConfig(world_size=world_size, local_world_size=local_world_size)
    return TopologyFactory.create_topology(trainer_config=trainer, hardware_config=hardware,
                                           kernel_config=KernelConfig(compute_device=topology["compute_device"]))


def table_constraints(ebc: EmbeddingBagCollection, kernel: str, sharding_types: list[str],
                      overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, ParameterConstraints]:
    """Per-table planner constraints; ``overrides[table]`` may set ``sharding_type`` / ``compute_kernel``."""
    overrides = dict(overrides or {})
    names = [t.name for t in ebc.embedding_bag_configs()]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"topology.table_overrides: unknown tables {unknown}; tables are {names}")
    for st in sharding_types:
        if st not in SHARDING_TYPES:
            raise ValueError(f"topology.sharding_types: {st!r} is not one of {sorted(SHARDING_TYPES)}")
    out = {}
    for name in names:
        o = overrides.get(name, {})
        k = o.get("compute_kernel", kernel)
        types = [o["sharding_type"]] if "sharding_type" in o else list(sharding_types)
        if k == EmbeddingComputeKernel.DENSE.value:
            types = [ShardingType.DATA_PARALLEL.value]
        out[name] = ParameterConstraints(sharding_types=types, compute_kernels=[k])
    return out


CPU_UNPLANNED = {ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value}


def manual_plan(ebcs: dict[str, EmbeddingBagCollection], constraints: Mapping[str, ParameterConstraints],
                world_size: int, local_world_size: int, device_type: str) -> ShardingPlan:
    """A plan without the planner: first allowed sharding type per table, greedy table-wise placement."""
    load = [0] * world_size
    plans = {}
    for path, ebc in ebcs.items():
        per_param = {}
        for cfg in sorted(ebc.embedding_bag_configs(), key=lambda c: -c.num_embeddings * c.embedding_dim):
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
                                                     world_size=world_size, device_type=device_type)
    return ShardingPlan(plan=plans)


def shard_model(model: nn.Module, embedding_optim: OptimizerSpec, topology: Mapping[str, Any],
                device: torch.device, plan: ShardingPlan | None = None,
                data_parallel: bool = True) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Attach the fused embedding optimizer, plan, and wrap ``model`` in DistributedModelParallel.

    ``model``'s embedding collections should be on the meta device: DMP materialises each shard on
    its rank only. ``data_parallel=False`` leaves the replicated parameters out of DDP (for k-step
    merging, :mod:`modules.kstep_merging`).
    """
    ebcs = {name: m for name, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}
    fused = is_fusable(embedding_optim, device.type)
    if fused:
        for ebc in ebcs.values():
            apply_optimizer_in_backward(OPTIMIZERS[embedding_optim.name], ebc.parameters(),
                                        embedding_optim.fused_kwargs())
    kernel = EmbeddingComputeKernel.FUSED.value if fused else EmbeddingComputeKernel.DENSE.value
    sharders = [EmbeddingBagCollectionSharder()]
    if plan is None:
        pg = dist.GroupMember.WORLD
        world = dist.get_world_size(pg)
        local_world = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        constraints: dict[str, ParameterConstraints] = {}
        for ebc in ebcs.values():
            constraints.update(table_constraints(ebc, kernel, list(topology["sharding_types"]),
                                                 topology.get("table_overrides")))
        forced_unplanned = any(c.sharding_types[0] in CPU_UNPLANNED for c in constraints.values())
        if topology.get("planner", "auto") == "manual" or (device.type == "cpu" and forced_unplanned):
            plan = manual_plan(ebcs, constraints, world, local_world, device.type)
        else:
            planner = EmbeddingShardingPlanner(topology=build_topology(topology, world, local_world),
                                               constraints=constraints)
            plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders,
                                   init_data_parallel=data_parallel)
    return dmp, plan
