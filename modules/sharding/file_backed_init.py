"""File-backed tables (the CPU ``ssd`` tier) while DistributedModelParallel is built: not drawn then — a row is drawn
when the row cache first meets it (:mod:`modules.embedding.row_init`, :mod:`modules.embedding.ssd_tier.files`)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

from modules.embedding.row_init import DrawnLater, RowInit
from modules.embedding.ssd_tier.files import CachedTable
from modules.sharding.placement import Placement
from modules.sharding.step_memory import Collection, collection_tables


@contextlib.contextmanager
def drawn_later(collections: list[Collection], file_backed: set[str], placements: Mapping[str, Placement]
                ) -> Iterator[dict[str, CachedTable]]:
    """While DMP is built: file-backed tables are not initialised (their rows are drawn when the row cache
    first meets them); yields each one's cache size and initialiser for :func:`file_backed_tables`."""
    configs = [c for ebc in collections for c in collection_tables(ebc) if c.name in file_backed]
    inits = {c.name: c.init_fn for c in configs}
    other = sorted(name for name, init in inits.items() if not isinstance(init, RowInit))
    if other:
        raise ValueError(f"tables {other} on the ssd tier: their rows must be drawn one by one when first met, which "
                         f"needs modules.embedding.row_init.RowInit as their init_fn")
    cached = {c.name: CachedTable(placements[c.name].cache_rows or 0, inits[c.name]) for c in configs}
    for c in configs:
        c.init_fn = DrawnLater(inits[c.name])
    try:
        yield cached
    finally:
        for c in configs:
            c.init_fn = inits[c.name]
