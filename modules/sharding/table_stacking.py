"""``model.stack_tables=auto``: the one-id features' tables become one stacked table
(:mod:`modules.embedding.sparse_arch`) when placement and sharding lose nothing by it.

Stacking keeps the model: the same rows, initialised with the same values (drawn per table and row,
:mod:`modules.embedding.row_init`), updated the same way. It changes what the planner sees:
one table instead of one per feature, so FBGEMM's CPU backward runs once instead of once per table
(≈ 7 % of a DeepFM step at batch 8,192 on CPU, docs/throughput.md). The tables are placed one by one
first (:func:`modules.sharding.placement.place_tables`); :func:`stacking_blocker` says when
the stacked table would be placed worse: tables forced in ``topology.table_overrides``, tables on
different tiers or on a tier sized per table, or several ranks without row-wise sharding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import torch
from torchrec import EmbeddingBagCollection
from torchrec.distributed.types import ShardingType

from modules.embedding.sparse_arch import EMB_PREFIX, FeatureSpec
from modules.models import ModelConfig, build_model
from modules.optim.optimizers import OptimizerSpec, is_fusable
from modules.sharding.placement import Placement, PlacementError, place_tables
from modules.sharding.planner import table_infos
from modules.sharding.step_memory import process_bytes
from modules.sharding.topology import TopologySpec


def decide_stacking(cfg: ModelConfig, spec: FeatureSpec, topology: TopologySpec, optimizer: OptimizerSpec,
                    coverage: Mapping[str, Mapping[float, int]] | None = None,
                    batch_rows: int = 0, eval_rows: int = 0, row_state_bytes: int = 0) -> tuple[ModelConfig, str]:
    """``cfg`` with ``stack_tables`` true or false, and why. ``topology``: as run (its world size);
    ``batch_rows`` / ``eval_rows``: the samples one kernel sees at once, as :func:`modules.sharding.planner.plan_model` takes them
    (the tables are placed as the plan will place them). Leaves the random state as it was: ``auto``
    trains the same model as the value it resolves to."""
    if cfg.stack_tables != "auto":
        return cfg, f"model.stack_tables={str(cfg.stack_tables).lower()}"
    with torch.random.fork_rng(devices=[]):  # the dense layers' draws stay for the model the run builds
        net = build_model(replace(cfg, stack_tables=False), spec, device=torch.device("meta"))
    ebc = next((m for m in net.modules() if isinstance(m, EmbeddingBagCollection)), None)
    tables = [t.name for t in ebc.embedding_bag_configs() if t.name.startswith(EMB_PREFIX)] if ebc else []
    if len(tables) < 2:
        why: str | None = "fewer than two one-id feature tables"
    else:
        try:
            placements = place_tables(table_infos(ebc, coverage), topology, optimizer.name,
                                      is_fusable(optimizer, topology.compute_device),
                                      process_bytes(net, batch_rows, topology.world_size, eval_rows),
                                      max(batch_rows, eval_rows), row_state_bytes)
            why = stacking_blocker(placements, tables, topology)
        except PlacementError as e:  # the plan of the unstacked model says it again
            why = f"the tables cannot be placed ({e})"
    return replace(cfg, stack_tables=why is None), why or "CPU, host memory, nothing forced, the ranks can share it"


def stacking_blocker(placements: Mapping[str, Placement], tables: Sequence[str], topology: TopologySpec) -> str | None:
    """Why ``tables``, placed one by one, should not become one stacked table (``model.stack_tables=auto``,
    :mod:`modules.sharding.table_stacking`); None: stacking gains and loses nothing else. The gain is FBGEMM's CPU
    backward running once instead of per table; on GPU its kernel already takes all tables at once. A
    stacked table has one tier and, table-wise, one rank: what the tables get anyway when none is forced
    in ``topology.table_overrides``, all are in host memory (``ssd`` files are per table), and there is
    one rank or row-wise sharding may spread the stacked table over the ranks."""
    if topology.compute_device != "cpu":
        return "a GPU topology: FBGEMM's GPU kernel takes all tables at once, stacking would only narrow the plan"
    forced = sorted(t for t in tables if t in topology.table_overrides)
    if forced:
        return f"topology.table_overrides names {forced[:3]}"
    tiers = sorted({placements[t].tier for t in tables})
    if tiers != ["host"]:
        return f"the tables are placed on {' and '.join(tiers)}"
    if topology.world_size > 1 and ShardingType.ROW_WISE.value not in topology.sharding_types:
        return f"{topology.world_size} ranks and no row_wise in topology.sharding_types {topology.sharding_types}"
    return None
