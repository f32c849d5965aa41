"""What a plan's placements need of this machine and run, checked before DistributedModelParallel builds anything
(:func:`modules.sharding.planner.shard_model`): a refusal names the tables and what to do instead."""

from __future__ import annotations

from typing import Mapping

from modules.embedding.ssd_tier.files import unavailable as files_unavailable
from modules.sharding.placement import KERNELS, Placement


def unrunnable(placements: Mapping[str, Placement], file_backed: set[str], copies: bool) -> str | None:
    """Why a plan's placements cannot be built here (None: they can): FBGEMM's SSD tables on CUDA (not wired yet,
    docs/gpu.md), the CPU ``ssd`` tier where this FBGEMM cannot back tables with files, or file-backed tables with
    copies of the tables (one rank's files cannot be merged)."""
    key_value = sorted(p.table for p in placements.values() if p.kernel == KERNELS["ssd"])
    if key_value:
        return (f"tables {key_value} go to the ssd tier on CUDA (FBGEMM's KEY_VALUE tables), which has not run yet: "
                f"their initial rows, topology.ssd.path and their checkpoints and model files are not wired; give them "
                f"host memory behind a GPU cache instead (+topology.table_overrides.<table>.tier=uvm_cache, or a larger "
                f"topology.ddr_cap_gb)")
    if file_backed and (why := files_unavailable()):
        return (f"tables {sorted(file_backed)} go to the CPU ssd tier, but {why}: raise topology.ddr_cap_gb to hold "
                f"them in memory, or install the pinned stack (pyproject.toml)")
    if file_backed and copies:
        return (f"tables {sorted(file_backed)} go to the ssd tier, whose files are one rank's: their copies cannot be "
                f"merged (trainer.merging.tables=replicated|per_node); use sharded")
    return None
