"""``data.preprocess``: how raw rows become the store (vocabularies, hashing, splits, bad rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SPLIT_METHODS = ("random", "sequential", "given")


@dataclass
class SplitConfig:
    method: str = "random"
    valid: float = 0.05
    test: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPLIT_METHODS:
            raise ValueError(f"method={self.method!r}: expected one of {SPLIT_METHODS}")
        if not (0 <= self.valid < 1 and 0 <= self.test < 1 and self.valid + self.test < 1):
            raise ValueError(f"valid={self.valid}, test={self.test}: expected fractions in [0, 1) with a sum < 1")


@dataclass
class PreprocessConfig:
    """``data.preprocess`` (numeric transforms are per feature: ``data.features[i].transform``)."""

    min_count: int = 2
    split: SplitConfig = field(default_factory=SplitConfig)
    categorical: str = "vocab"         # vocab | hash | raw (64-bit ids, no vocabulary: model.zch maps them to rows)
    hash_buckets: int = 1 << 20        # buckets per table with categorical=hash
    bad_rows: str = "error"            # error | skip
    block_size: int = 32 << 20         # bytes of text per parsed block
    # An earlier store / model folder: its ids kept, new values appended. "auto": trainer.init_from's
    # vocabulary when a run starts from one (resolved by pipeline.config.parse_config), else none; null: none.
    base_vocabulary: Optional[str] = "auto"
    evict_after: Optional[int] = None      # with a base: drop values unseen for this many days (ids reused)

    @property
    def base(self) -> Optional[str]:
        """The base vocabulary's folder, or None (``base_vocabulary`` null, or "auto" left unresolved)."""
        return None if self.base_vocabulary in (None, "auto") else self.base_vocabulary

    def __post_init__(self) -> None:
        if self.evict_after is not None and self.evict_after < 1:
            raise ValueError(f"evict_after={self.evict_after}: expected a number of days >= 1 or null")
        if self.categorical not in ("vocab", "hash", "raw"):
            raise ValueError(f"categorical={self.categorical!r}: expected 'vocab', 'hash' or 'raw'")
        if self.categorical == "raw" and self.evict_after is not None:
            raise ValueError(f"evict_after={self.evict_after} with categorical='raw': raw ids have no vocabulary to "
                             f"evict from; set model.zch.eviction instead")
        if self.bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows={self.bad_rows!r}: expected 'error' or 'skip'")
        if self.min_count < 1 or self.hash_buckets < 1:
            raise ValueError(f"min_count={self.min_count}, hash_buckets={self.hash_buckets}: expected values >= 1")
