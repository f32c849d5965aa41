"""Sparse k-step merging of replicated embedding tables (``trainer.merging.tables=replicated``).

Every rank holds every table whole and trains it on its own batches with its own (fused) optimizer: a
lookup never crosses the link. Every ``k`` steps each row that some rank looked up since the last merge is
replaced by its mean over the ranks that looked it up:

    w_i ← Σ_r t_ri · w_ri / Σ_r t_ri        t_ri = 1 if rank r looked up row i since the last merge, else 0

Rows nobody looked up are still equal on every rank. A row only one rank met keeps that rank's update
whole (a plain mean over all ranks would shrink it by the world size); a row every rank met gets the plain
mean of dense k-step merging (:mod:`modules.optim.kstep_merging`). Between merges a rank does not see the
others' updates of a row: up to ``k`` steps of staleness, as for the dense part. The optimizer's state of
the rows (Adam moments, Adagrad sums) stays each rank's own.

Bytes per merge: the ids looked up (all-gathered, 8 bytes each) and ``|U|·(D+1)`` float32 values
all-reduced, ``U`` the union of the rows looked up on all ranks: traffic scales with the distinct rows of
``k`` batches, not with samples × features as the pooled all-to-all of sharded tables does. This is the
pass of PaddleBox (Zhao et al., "Communication-efficient TeraByte-scale model training framework for online
advertising", IEEE BigData 2022, arXiv 2201.05500): pull the rows a pass of batches needs once,
deduplicated, train on them locally, push the updates back at the pass's end.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from modules.comm_accounting import comm_category


class TableMerger:
    """``tables``: name → the rank's whole table (rows × dim), written in place by :meth:`merge`."""

    def __init__(self, tables: Mapping[str, torch.Tensor]) -> None:
        self.tables = dict(tables)
        self.names = sorted(self.tables)
        self.first_row: dict[str, int] = {}  # each table's rows in one index over all tables
        rows = 0
        for name in self.names:
            self.first_row[name] = rows
            rows += self.tables[name].shape[0]
        self.touched = torch.zeros(rows, dtype=torch.bool)
        self.merged_rows = 0  # rows averaged over the run (for the record)

    @torch.no_grad()
    def make_equal(self, group: dist.ProcessGroup | None = None) -> None:
        """Give every rank rank 0's tables where they differ (compared by a checksum of each table: a table
        drawn from the same seed everywhere crosses no link)."""
        sums = torch.stack([(w.double() * torch.arange(1, w.shape[0] + 1, dtype=torch.float64).unsqueeze(1)).sum()
                            for w in (self.tables[n] for n in self.names)]) if self.names else torch.zeros(0)
        first = sums.clone()
        dist.broadcast(first, src=0, group=group)
        differ = (sums != first).to(torch.int64)
        dist.all_reduce(differ, group=group)
        for name, d in zip(self.names, differ.tolist()):
            if d:
                dist.broadcast(self.tables[name], src=0, group=group)

    def record(self, table: str, ids: torch.Tensor) -> None:
        """Mark the rows ``ids`` of ``table`` looked up (call for every training lookup)."""
        self.touched[ids.to(torch.int64) + self.first_row[table]] = True

    def _union(self, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The sorted union of every rank's ``local`` ids."""
        world = dist.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([local.numel()]), group=group)
        longest = int(max(c.item() for c in counts))
        padded = torch.full((longest,), -1, dtype=torch.int64)
        padded[:local.numel()] = local
        everyone = [torch.empty(longest, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(everyone, padded, group=group)
        ids = torch.cat(everyone)
        return torch.unique(ids[ids >= 0])

    @torch.no_grad()
    def merge(self, group: dist.ProcessGroup | None = None) -> int:
        """Average the looked-up rows over the ranks that looked them up; returns how many rows that was."""
        local = self.touched.nonzero().squeeze(1)
        with comm_category("merge"):
            union = self._union(local, group)
            by_dim: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for name in self.names:  # one all-reduce per row width
                lo = self.first_row[name]
                hi = lo + self.tables[name].shape[0]
                part = union[(union >= lo) & (union < hi)]
                if part.numel():
                    by_dim.setdefault(self.tables[name].shape[1], []).append((name, part))
            for dim, parts in sorted(by_dim.items()):
                buf = torch.cat([self._weighted(name, ids) for name, ids in parts])
                dist.all_reduce(buf, group=group)
                means = buf[:, :dim] / buf[:, dim:]
                at = 0
                for name, ids in parts:
                    self.tables[name][ids - self.first_row[name]] = means[at:at + ids.numel()]
                    at += ids.numel()
        self.touched[local] = False
        self.merged_rows += union.numel()
        return union.numel()

    def _weighted(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """``[t · w, t]`` for the rows ``ids`` (indices over all tables) of ``name``: this rank's share of the sums."""
        table = self.tables[name]
        mine = self.touched[ids].to(table.dtype).unsqueeze(1)
        return torch.cat([table[ids - self.first_row[name]] * mine, mine], dim=1)
