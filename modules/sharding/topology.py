"""``topology``: the hardware embedding tables are placed on (``conf/topology/*.yaml``) — nodes and ranks,
each tier's capacity and reserve, bandwidths, the sharding types allowed, per-table overrides — as a
typed config checked once. The placement itself is :mod:`modules.sharding.placement`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

from torchrec.distributed.types import ShardingType

GB = 1024**3
TIERS = ("hbm", "uvm_cache", "ssd", "host")
SHARDING_TYPES = tuple(t.value for t in ShardingType)
PLANNERS = ("auto", "manual")


@dataclass
class SsdSpec:
    path: Optional[str] = None     # where ssd-tier tables keep their files (GPU: FBGEMM's SSD TBE; CPU: memory maps)
    cap_gb: float = 0.0            # per node; on CPU 0 means the free space at path
    cache_mb: Optional[float] = None  # CPU: the row cache per rank, outright (None: what ddr_cap_gb leaves)
    cache_policy: str = "lfu"      # CPU row cache eviction: lfu | lru (docs/ssd_tier.md: LFU hit more on both id orders)
    # CPU: the next training batch's rows brought into the row cache in a thread while a step computes (one
    # process, no model.zch; modules/embedding/ssd_tier/rows_ahead.py). Off by default: on 2 cores it gained 5 %
    # on a frequency-ordered table and lost 6-11 % on a hashed one (docs/ssd_tier.md)
    look_ahead: bool = False

    def __post_init__(self) -> None:
        if self.cache_policy not in ("lru", "lfu"):
            raise ValueError(f"ssd.cache_policy={self.cache_policy!r}: expected lru or lfu")
        if self.cache_mb is not None and self.cache_mb <= 0:
            raise ValueError(f"ssd.cache_mb={self.cache_mb}: expected a positive size in MB (or null)")


@dataclass
class Bandwidths:
    """GB/s; None: TorchRec's planner default."""

    hbm: Optional[float] = None
    host_memory: Optional[float] = None
    host_link: Optional[float] = None   # GPU ↔ host (PCIe / C2C)
    intra_node: Optional[float] = None
    inter_node: Optional[float] = None
    ssd: Optional[float] = None


@dataclass
class TableOverride:
    """``topology.table_overrides.<table>``: force a tier / kernel, cache size or sharding type."""

    tier: Optional[str] = None
    compute_kernel: Optional[str] = None
    cache_load_factor: Optional[float] = None
    sharding_type: Optional[str] = None

    def __post_init__(self) -> None:
        if self.tier is not None and self.tier not in TIERS:
            raise ValueError(f"tier={self.tier!r}: expected one of {', '.join(TIERS)}")
        if self.sharding_type is not None and self.sharding_type not in SHARDING_TYPES:
            raise ValueError(f"sharding_type={self.sharding_type!r}: expected one of {list(SHARDING_TYPES)}")


@dataclass
class TopologySpec:
    """``topology``: the hardware the tables are placed on (``conf/topology/*.yaml``)."""

    compute_device: str = "cpu"
    name: str = "unnamed"
    nodes: int = 1
    ranks_per_node: Optional[int] = None   # None: as many as torchrun starts per node (LOCAL_WORLD_SIZE)
    hbm_cap_gb: float = 0.0        # per GPU
    ddr_cap_gb: float = 0.0        # host memory per node
    ssd: SsdSpec = field(default_factory=SsdSpec)
    hbm_reserve: float = 0.25
    ddr_reserve: float = 0.25
    cache_coverage: float = 0.9
    min_cache_load_factor: float = 0.01
    bandwidth_gbps: Bandwidths = field(default_factory=Bandwidths)
    numa: Optional[List[int]] = None       # NUMA node of each GPU (None: read from /sys)
    sharding_types: List[str] = field(default_factory=lambda: [ShardingType.TABLE_WISE.value])
    # table → TableOverride; untyped in the schema so that `+topology.table_overrides.<t>.tier=...` adds one
    table_overrides: Dict[str, Any] = field(default_factory=dict)
    planner: str = "auto"                  # auto: TorchRec's planner | manual: first allowed type per table

    def __post_init__(self) -> None:
        overrides = {}
        for table, o in self.table_overrides.items():
            if not isinstance(o, TableOverride):
                unknown = sorted(set(o) - set(TableOverride.__dataclass_fields__))
                if unknown:
                    raise ValueError(f"table_overrides.{table}: unknown keys {unknown}; expected some of "
                                     f"{sorted(TableOverride.__dataclass_fields__)}")
                try:
                    o = TableOverride(**o)
                except ValueError as e:
                    raise ValueError(f"table_overrides.{table}.{e}") from None
            overrides[table] = o
        self.table_overrides = overrides
        if self.compute_device not in ("cpu", "cuda"):
            raise ValueError(f"compute_device={self.compute_device!r}: expected 'cpu' or 'cuda'")
        bad = [t for t in self.sharding_types if t not in SHARDING_TYPES]
        if bad:
            raise ValueError(f"sharding_types: {bad} not among {list(SHARDING_TYPES)}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner={self.planner!r}: expected one of {PLANNERS}")
        for key in ("hbm_reserve", "ddr_reserve", "cache_coverage", "min_cache_load_factor"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key}={getattr(self, key)}: expected a share in [0, 1]")

    def for_world(self, world_size: int, ranks_per_node: int) -> "TopologySpec":
        """This topology as run: ``world_size`` ranks, ``ranks_per_node`` on each node."""
        return replace(self, ranks_per_node=ranks_per_node, nodes=max(1, world_size // ranks_per_node))

    def on_ranks(self, world_size: int) -> "TopologySpec":
        """This topology run on ``world_size`` ranks: ``ranks_per_node`` of them per node when set, else all on one."""
        return self.for_world(world_size, min(world_size, self.ranks_per_node or world_size))

    @property
    def world_size(self) -> int:
        return self.nodes * (self.ranks_per_node or 1)

    def budgets(self) -> dict[str, float]:
        return {
            "hbm": self.world_size * self.hbm_cap_gb * GB * (1 - self.hbm_reserve),
            "host": self.nodes * self.ddr_cap_gb * GB * (1 - self.ddr_reserve),
            "ssd": self.nodes * self.ssd.cap_gb * GB,
        }
