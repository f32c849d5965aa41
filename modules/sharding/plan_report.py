"""A sharding plan as a table for people: per table its rows, dim, bytes (weights + optimizer state),
sharding type, tier, kernel, cache load factor, the CPU ``ssd`` tier's row cache (rows and MiB) and
ranks; then the estimated memory per tier on each rank (TorchRec's planner estimates; for a manual plan
each table's bytes split over its ranks, row caches counted in host memory)."""

from __future__ import annotations

from collections import defaultdict

from modules.sharding.planner import PlanResult
from modules.sharding.topology import GB


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
                    per_rank[r]["ddr"] += p.cache_bytes / len(ranks)
    return dict(sorted(per_rank.items()))


def format_plan(result: PlanResult, optimizer: str, world_size: int, title: str = "") -> str:
    shardings = {name: ps for mp in result.plan.plan.values() for name, ps in mp.items()}
    lines = [title] if title else []
    lines += ["| table | rows | dim | bytes | sharding | tier | kernel | cache load factor | row cache | ranks |",
              "|---|---:|---:|---:|---|---|---|---:|---:|---|"]
    for name, p in result.placements.items():
        ps = shardings.get(name)
        ranks = sorted(set(ps.ranks)) if ps is not None and ps.ranks else []
        rank_text = f"{ranks[0]}–{ranks[-1]}" if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
            else ",".join(map(str, ranks)) or "all"
        lf = f"{p.cache_load_factor:.3f}" if p.cache_load_factor else ""
        cache = f"{p.cache_rows:,} rows, {p.cache_bytes / 2**20:,.1f} MiB" if p.cache_rows else ""
        cache += f", ~{p.cache_share:.0%} of lookups" if p.cache_rows and p.cache_share is not None else ""
        lines.append(f"| {name} | {p.rows:,} | {p.dim} | {p.bytes / 2**20:,.1f} MiB | "
                     f"{ps.sharding_type if ps else '?'} | {p.tier} | {p.kernel} | {lf} | {cache} | {rank_text} |")
    total = sum(p.bytes for p in result.placements.values())
    lines += ["", f"total embedding bytes (weights + {optimizer} state): {total / GB:,.2f} GiB", "",
              "| rank | HBM GiB | host DDR GiB | SSD GiB |", "|---:|---:|---:|---:|"]
    for rank, mem in memory_per_rank(result, world_size).items():
        lines.append(f"| {rank} | {mem['hbm'] / GB:,.2f} | {mem['ddr'] / GB:,.2f} | {mem['ssd'] / GB:,.2f} |")
    return "\n".join(lines) + "\n"
