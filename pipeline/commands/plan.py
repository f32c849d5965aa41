"""Show where the embedding tables go: ``ctr plan topology=<name> data=<name> [model=...]``.

Prints one row per table — rows, dim, bytes (weights + optimizer state), sharding type, tier and
kernel, ranks — and the estimated memory per tier per rank (TorchRec's planner estimates). Works
without a GPU: GPU topologies are planned, not run. ``data`` may be a prepared dataset (its measured
id-frequency statistics size the caches) or a shape-only description such as ``criteo_kaggle_shape``.
"""

from __future__ import annotations

from collections import defaultdict

import hydra
import torch
from omegaconf import DictConfig

from modules.embedding import FeatureSpec
from modules.models import build_model
from modules.placement import GB, zipf_coverage
from modules.sharding import PlanResult, plan_model
from pipeline.commands.args import exit_on_user_error
from pipeline.config import ConfigError, parse_config
from pipeline.data.datamodule import CTRDataModule
from pipeline.data.dataset import DataConfig
from pipeline.data.store import FIRST_VOCAB_ID


def spec_and_coverage(data: DataConfig, cache_dir: str) -> tuple[FeatureSpec, dict[str, dict[float, int]]]:
    """Feature spec and id-coverage statistics of a dataset (prepared on first use) or a shape-only config."""
    if data.shape_only:
        tables = list(dict.fromkeys(data.table_of(f) for f in (*data.categorical, *data.sequence)))
        if data.cardinalities is None or len(data.cardinalities) != len(tables):
            raise ConfigError(f"data.cardinalities: expected {len(tables)} counts (one per embedding table: "
                              f"{tables[:5]}{' ...' if len(tables) > 5 else ''})")
        sizes = {t: int(n) + FIRST_VOCAB_ID for t, n in zip(tables, data.cardinalities)}
        coverage = {t: zipf_coverage(n, data.zipf_exponent) for t, n in sizes.items()}
        return FeatureSpec.of_data(data, sizes), coverage
    dm = CTRDataModule(data, cache_dir, batch_size=1, eval_batch_size=1, seed=0)
    dm.prepare_data()
    dm.setup()
    return dm.feature_spec, dm.coverage


def memory_per_rank(result: PlanResult, world_size: int) -> dict[int, dict[str, float]]:
    """Estimated bytes per tier on each rank (TorchRec's storage estimates of the chosen shards)."""
    per_rank: dict[int, dict[str, float]] = defaultdict(lambda: {"hbm": 0.0, "ddr": 0.0, "ssd": 0.0})
    best = getattr(result.planner, "_best_plan", None) if result.planner is not None else None
    if best:
        for option in best:
            for shard in option.shards:
                if shard.rank is not None and shard.storage is not None:
                    for tier in ("hbm", "ddr", "ssd"):
                        per_rank[shard.rank][tier] += getattr(shard.storage, tier)
    else:  # manual plan: each table's bytes split over its ranks, on its tier
        for module_plan in result.plan.plan.values():
            for name, ps in module_plan.items():
                p = result.placements[name]
                ranks = ps.ranks or list(range(world_size))
                tier = {"hbm": "hbm", "uvm_cache": "ddr", "ssd": "ssd", "host": "ddr"}[p.tier]
                for r in ranks:
                    per_rank[r][tier] += p.bytes / len(ranks)
    return dict(sorted(per_rank.items()))


def format_plan(result: PlanResult, optimizer: str, world_size: int, title: str = "") -> str:
    shardings = {name: ps for mp in result.plan.plan.values() for name, ps in mp.items()}
    lines = [title] if title else []
    lines += ["| table | rows | dim | bytes | sharding | tier | kernel | cache load factor | ranks |",
              "|---|---:|---:|---:|---|---|---|---:|---|"]
    for name, p in result.placements.items():
        ps = shardings.get(name)
        ranks = sorted(set(ps.ranks)) if ps is not None and ps.ranks else []
        rank_text = f"{ranks[0]}–{ranks[-1]}" if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
            else ",".join(map(str, ranks)) or "all"
        lf = f"{p.cache_load_factor:.3f}" if p.cache_load_factor else ""
        lines.append(f"| {name} | {p.rows:,} | {p.dim} | {p.bytes / 2**20:,.1f} MiB | "
                     f"{ps.sharding_type if ps else '?'} | {p.tier} | {p.kernel} | {lf} | {rank_text} |")
    total = sum(p.bytes for p in result.placements.values())
    lines += ["", f"total embedding bytes (weights + {optimizer} state): {total / GB:,.2f} GiB", "",
              "| rank | HBM GiB | host DDR GiB | SSD GiB |", "|---:|---:|---:|---:|"]
    for rank, mem in memory_per_rank(result, world_size).items():
        lines.append(f"| {rank} | {mem['hbm'] / GB:,.2f} | {mem['ddr'] / GB:,.2f} | {mem['ssd'] / GB:,.2f} |")
    return "\n".join(lines) + "\n"


def plan_for_config(cfg: DictConfig) -> str:
    run = parse_config(cfg)
    topology = run.topology.for_world(run.topology.world_size, run.topology.ranks_per_node or 1)
    feature_spec, coverage = spec_and_coverage(run.data, run.paths.cache_dir)
    model = build_model(run.model, feature_spec, device=torch.device("meta"))
    optim = run.optim.embedding
    result = plan_model(model, optim, topology, coverage,
                        table_of={f: feature_spec.table_of(f) for f in feature_spec.sparse})
    title = (f"Plan for data={run.data.name} model={run.model.name} on topology={topology.name} "
             f"({topology.nodes} node(s) × {topology.ranks_per_node} {topology.compute_device} rank(s)), "
             f"embedding optimizer {optim.name}\n")
    return format_plan(result, optim.name, topology.world_size, title)


@hydra.main(version_base="1.3", config_path="pkg://ctr_conf", config_name="config")
def cli(cfg: DictConfig) -> None:
    """``ctr plan`` / ``python -m pipeline.commands.plan``."""
    print(exit_on_user_error(lambda: plan_for_config(cfg)))


if __name__ == "__main__":
    cli()
