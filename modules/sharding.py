"""Planning and applying TorchRec sharding: topology → planner → DistributedModelParallel.

The planner (``EmbeddingShardingPlanner``) receives a ``Topology`` built from the run's topology
config and per-table ``ParameterConstraints`` (allowed sharding types and compute kernel). The
kernel follows the embedding optimizer: ``fused`` (optimizer in FBGEMM's backward) when the device
has it, otherwise ``dense`` with data-parallel sharding (see :mod:`modules.optimizers`).
"""

from __future__ import annotations

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


def shard_model(model: nn.Module, embedding_optim: OptimizerSpec, topology: Mapping[str, Any],
                device: torch.device, plan: ShardingPlan | None = None) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Attach the fused embedding optimizer, plan, and wrap ``model`` in DistributedModelParallel.

    ``model`` should be built on the meta device: DMP materialises each shard on its rank only.
    """
    ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    fused = is_fusable(embedding_optim, device.type)
    if fused:
        for ebc in ebcs:
            apply_optimizer_in_backward(OPTIMIZERS[embedding_optim.name], ebc.parameters(),
                                        embedding_optim.fused_kwargs())
    kernel = EmbeddingComputeKernel.FUSED.value if fused else EmbeddingComputeKernel.DENSE.value
    sharders = [EmbeddingBagCollectionSharder()]
    if plan is None:
        pg = dist.GroupMember.WORLD
        world = dist.get_world_size(pg)
        local_world = int(topology.get("ranks_per_node") or 0) or min(world, int(_env_local_world_size()))
        constraints: dict[str, ParameterConstraints] = {}
        for ebc in ebcs:
            constraints.update(table_constraints(ebc, kernel, list(topology["sharding_types"]),
                                                 topology.get("table_overrides")))
        planner = EmbeddingShardingPlanner(topology=build_topology(topology, world, local_world),
                                           constraints=constraints)
        plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    return dmp, plan


def _env_local_world_size() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
