"""``ctr serve``'s settings, parsed once from ``conf/serving/serve.yaml`` and the command line (:mod:`pipeline.commands
.serve`) and handed whole to every worker (:mod:`.app`, as JSON in its environment)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.runtime.bf16 import native_bf16
from pipeline.runtime.errors import ConfigError

RANK_DENSE = ("fp32", "bf16", "auto")


@dataclass
class ServeSettings:
    """``serve.*``: the types here, the defaults and what each key does in ``conf/serving/serve.yaml`` alone."""

    host: str
    port: int
    workers: int
    threads: int
    max_batch_rows: int
    small_batch_rows: int
    rank_dense: str
    max_wait_ms: float
    max_queued_mb: float
    max_queued_requests: int
    max_connections: int
    watch: str
    watch_interval_s: float
    dir: str

    def __post_init__(self) -> None:
        for key in ("workers", "threads", "max_batch_rows", "max_queued_requests", "max_connections"):
            if getattr(self, key) < 1:
                raise ConfigError(f"serve.{key}={getattr(self, key)}: expected a whole number ≥ 1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port={self.port}: expected 0 … 65535")
        if self.small_batch_rows < 0:
            raise ConfigError(f"serve.small_batch_rows={self.small_batch_rows}: expected a whole number ≥ 0")
        if not self.max_queued_mb > 0:
            raise ConfigError(f"serve.max_queued_mb={self.max_queued_mb}: expected MiB > 0")
        if self.rank_dense not in RANK_DENSE:
            raise ConfigError(f"serve.rank_dense={self.rank_dense!r}: expected one of {', '.join(RANK_DENSE)}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"serve.max_wait_ms={self.max_wait_ms}: expected ≥ 0")
        if self.watch_interval_s <= 0:
            raise ConfigError(f"serve.watch_interval_s={self.watch_interval_s}: expected > 0")

    @property
    def max_queued_bytes(self) -> int:
        """``max_queued_mb`` in bytes: the bodies a worker holds, and so the largest body it takes."""
        return int(self.max_queued_mb * 2**20)

    @property
    def rank_dtype(self) -> str:
        """``rank_dense`` resolved: ``auto`` is bf16 where the CPU computes it natively, else fp32."""
        if self.rank_dense != "auto":
            return self.rank_dense
        return "bf16" if native_bf16("cpu")[0] else "fp32"

    @property
    def poll_s(self) -> float:
        """How often a worker looks for a newly published version."""
        return min(1.0, self.watch_interval_s)
