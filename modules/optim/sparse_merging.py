"""Sparse k-step merging of replicated embedding tables (``trainer.merging.tables=replicated``).

Every rank holds every table whole and trains it on its own batches with its own (fused) optimizer: a
lookup never crosses the link. Every ``k`` steps each row that some rank looked up since the last merge
gets the updates of the n_i ranks that looked it up, summed and divided by √n_i:

    w_i ← b_i + Σ_r (w_ri − b_i) / √n_i        b_i: the row at the last merge (equal on every rank)

A rank that did not look up row i adds nothing (w_ri = b_i); a row one rank met keeps that rank's update whole.
Why √n: with an optimizer that normalises each rank's step (Adagrad, Adam) a rank's update of a row has about the
size of one synchronous step. n updates that agree (signal) add up to n steps, where synchronous training takes
one: the mean is right. n updates that are independent noise add up to √n steps, as the synchronous step on their
averaged gradient does: the sum is right for them only after dividing by √n. A row met by few samples a pass is
mostly noise. Measured (DeepFM, rowwise Adagrad, docs/kstep_merging.md), test AUC against DDP's at k = 8: on 2
ranks mean −0.0018, sum −0.0001, √n −0.0007; on 4 ranks over 62 steps mean −0.0071, sum −0.0157 (n = 4 steps at
once on the hottest rows), √n −0.0012 (as much as sharded k-step merging lost there). This is the push of a
parameter server, and the pass of PaddleBox (Zhao et al., "Communication-efficient TeraByte-scale model training
framework for online advertising", IEEE BigData 2022, arXiv 2201.05500): pull the rows a pass of batches needs
once, train on them locally, push the updates back at the pass's end. Between merges a rank does not see the
others' updates of a row: up to ``k`` steps of staleness, as for the dense part. The optimizer's state of the
rows (Adagrad sums, Adam moments) stays each rank's own.

Bytes per merge: the ids looked up (all-gathered, 4 bytes each below 2³¹ rows in all), then per row width D the
cheaper of two exchanges, chosen alike on every rank from those ids: each rank's own updates all-gathered (``L·D``
values a rank, L the most rows one rank met: a rank receives W − 1 such buffers) or ``|U|·(D+1)`` values
all-reduced (the updates and a count: a ring moves 2 (W − 1)/W of it), ``U`` the union of the rows looked up on all
ranks — the first wins where the copies are few (two nodes: L ≤ |U| always) or meet different rows. Values travel in
fp32 or fp16 (``updates``; an update is a small difference, which fp16 holds to ~5·10⁻⁴ of itself, where the rows
themselves would lose their low bits). Traffic scales with the distinct rows of ``k`` batches, not with samples ×
features as the pooled all-to-all of sharded tables does.

Rows in fp16 (``model.table_precision``): the updates ``w − b`` and their merge are taken in fp32 from the fp16 rows
(exact), and a merged row is ``b + u`` rounded to fp16 once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from modules.comm_accounting import comm_category

UPDATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class TablePass:
    """One rank's part of a merge: the rows it looked up (indices over all tables, sorted: ``ids``) and, per
    table, (name, its rows, their updates ``w − b``, their ``b``)."""

    ids: torch.Tensor
    parts: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]


def _checksum(table: torch.Tensor, block: int = 1 << 16) -> float:
    """Σ_i (i + 1) · Σ_j w_ij in float64, a block of rows at a time (no copy of the whole table)."""
    total = 0.0
    for lo in range(0, table.shape[0], block):
        rows = table[lo:lo + block].double().sum(dim=1)
        total += float((rows * torch.arange(lo + 1, lo + 1 + rows.numel(), dtype=torch.float64, device="cpu")).sum())
    return total


class TableMerger:
    """``tables``: name → the rank's whole table (rows × dim), written in place by :meth:`merge`."""

    def __init__(self, tables: Mapping[str, torch.Tensor], updates: str = "fp32") -> None:
        if updates not in UPDATE_DTYPES:
            raise ValueError(f"updates={updates!r}: expected one of {sorted(UPDATE_DTYPES)}")
        self.update_dtype = UPDATE_DTYPES[updates]
        self.tables = dict(tables)
        self.names = sorted(self.tables)
        self.first_row: dict[str, int] = {}  # each table's rows in one index over all tables
        rows = 0
        for name in self.names:
            self.first_row[name] = rows
            rows += self.tables[name].shape[0]
        self.starts = torch.tensor([self.first_row[n] for n in self.names], device="cpu")  # first rows, in name order
        self.touched = torch.zeros(rows, dtype=torch.bool, device="cpu")
        self.id_dtype = torch.int32 if rows < 2**31 else torch.int64  # the ids all-gathered
        # per table, (ids, rows) as they were before this rank's first update since the last merge
        self._base: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.merged_rows = 0  # rows merged over the run (for the record)

    def check_alike(self, group: dist.ProcessGroup | None = None) -> None:
        """Refuse to merge unless every rank of ``group`` holds the same shards (name and shape): each node plans its
        copy alone, and copies planned differently would merge unrelated rows. The ranks' layouts are gathered (a
        few numbers a table) and the first difference named."""
        mine = sorted((name, tuple(t.shape)) for name, t in self.tables.items())
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                only_here, only_there = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
                raise RuntimeError(
                    f"the copies of the tables are not sharded alike: this rank holds {only_here[:3]}, where rank "
                    f"{rank} of its merge group holds {only_there[:3]} (each node plans its copy: the topology, "
                    f"table overrides or library versions differ between nodes)")

    @torch.no_grad()
    def make_equal(self, group: dist.ProcessGroup | None = None) -> None:
        """Give every rank of ``group`` (None: all) its first rank's tables where they differ (compared by a checksum
        of each table: a table drawn from the same seed everywhere crosses no link)."""
        self.check_alike(group)
        sums = torch.tensor([_checksum(self.tables[n]) for n in self.names], dtype=torch.float64, device="cpu")
        first = sums.clone()
        dist.broadcast(first, group=group, group_src=0)
        differ = (sums != first).to(torch.int64)
        dist.all_reduce(differ, group=group)
        for name, d in zip(self.names, differ.tolist()):
            if d:
                dist.broadcast(self.tables[name], group=group, group_src=0)

    @torch.no_grad()
    def record(self, table: str, ids: torch.Tensor) -> None:
        """Mark the rows ``ids`` of ``table`` looked up (see :meth:`record_rows`)."""
        self.record_rows(ids.to(torch.int64) + self.first_row[table])

    @torch.no_grad()
    def record_rows(self, rows: torch.Tensor) -> None:
        """Mark ``rows`` (indices over all tables, int64) looked up; call before the step updates them (a forward
        pre-hook): a row met for the first time since the last merge is kept as it was (its ``b``)."""
        new = torch.unique(rows[~self.touched[rows]])
        if not new.numel():
            return
        self.touched[new] = True
        counts = torch.bincount(torch.searchsorted(self.starts, new, right=True) - 1, minlength=len(self.names))
        for name, part in zip(self.names, new.split(counts.tolist())):
            if part.numel():
                self._base.setdefault(name, []).append((part, self.tables[name][part - self.first_row[name]].clone()))

    def state_dict(self, tables: bool = True) -> dict:
        """What a checkpoint must hold for the merges to go on as if it had not been written: the rows met since the
        last merge and their kept ``b`` (and, with ``tables``, this rank's shards themselves: between merges each copy
        holds its own rows). Live tensors, not copies: written at once."""
        return {"touched": self.touched, "merged_rows": self.merged_rows,
                "bases": {name: [[ids, rows] for ids, rows in kept] for name, kept in self._base.items()},
                "tables": self.tables if tables else None}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (its ``tables`` copied into this rank's shards, if saved)."""
        self.touched.copy_(state["touched"])
        self.merged_rows = int(state["merged_rows"])
        self._base = {name: [(ids, rows) for ids, rows in kept] for name, kept in state["bases"].items()}
        for name, saved in (state["tables"] or {}).items():
            self.tables[name].copy_(saved)

    def _gathered_ids(self, local: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """Every rank's ``local`` ids (sorted; all-gathered as ``id_dtype``, padded to the longest)."""
        world = dist.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.int64, device="cpu") for _ in range(world)]
        dist.all_gather(counts, torch.tensor([local.numel()], device="cpu"), group=group)
        longest = int(max(c.item() for c in counts))
        padded = torch.full((longest,), -1, dtype=self.id_dtype, device="cpu")
        padded[:local.numel()] = local
        everyone = [torch.empty(longest, dtype=self.id_dtype, device="cpu") for _ in range(world)]
        dist.all_gather(everyone, padded, group=group)
        return [ids[:int(n.item())].to(torch.int64) for ids, n in zip(everyone, counts)]

    def _rows_of(self, ids: torch.Tensor, name: str) -> torch.Tensor:
        """The rows of table ``name`` among ``ids`` (sorted indices over all tables), as the table's own rows."""
        lo = self.first_row[name]
        return ids[(ids >= lo) & (ids < lo + self.tables[name].shape[0])] - lo

    @torch.no_grad()
    def merge(self, group: dist.ProcessGroup | None = None) -> int:
        """Apply the updates of the rows looked up since the last merge (the module's formula, each row set to
        ``b`` plus its merged update: equal on every rank); returns how many rows that was."""
        sent = self.snapshot()
        merged = self.exchange(sent, group)
        mine = {name: (own, base) for name, own, _, base in sent.parts}
        for name, ids, update in merged:
            own, base = mine[name]
            table = self.tables[name]
            rows = table[ids].float()  # b where no rank here updated the row since the last merge
            rows[torch.searchsorted(ids, own)] = base
            table[ids] = (rows + update).to(table.dtype)  # fp16 rows (model.table_precision): b + u rounded once
        return sum(ids.numel() for _, ids, _ in merged)

    @torch.no_grad()
    def snapshot(self) -> "TablePass":
        """This rank's part of a merge, taken now: the rows it looked up since the last merge, their ``b`` and
        their updates ``w − b``; the next pass starts (rows met from now on are kept as they are then)."""
        local = self.touched.nonzero().squeeze(1)
        parts = []
        for name in self.names:
            ids = self._rows_of(local, name)
            base = self._bases(name, ids + self.first_row[name])
            parts.append((name, ids, self.tables[name][ids].float() - base, base))
        self.touched[local] = False
        self._base.clear()
        return TablePass(local.to(self.id_dtype), parts)

    def exchange(self, sent: "TablePass", group: dist.ProcessGroup | None = None) -> list[tuple[str, torch.Tensor,
                                                                                             torch.Tensor]]:
        """The merged update ``Σ_r (w_r − b) / √n`` of every row some rank looked up, as (table, its rows, the
        update); reads no table (it may run while training goes on). Per row width d the updates travel the way
        that moves fewer bytes for these ids, every rank deciding alike from the gathered ids: each rank's own rows
        all-gathered (each rank receives W − 1 buffers of L·d values, L the most rows a rank met: fewer bytes
        where the copies are few or meet different rows), or the rows of the union U with a count all-reduced
        (a ring moves 2 (W − 1)/W · U·(d + 1) values: fewer where many copies meet the same rows)."""
        with torch.no_grad(), comm_category("merge"):
            everyone = self._gathered_ids(sent.ids, group)
            union = torch.unique(torch.cat(everyone))
            by_dim: dict[int, list[int]] = {}
            for i, (_, _, delta, _) in enumerate(sent.parts):
                by_dim.setdefault(delta.shape[1], []).append(i)
            out = []
            for dim, parts in sorted(by_dim.items()):
                names = [sent.parts[i][0] for i in parts]
                rows = [self._rows_of(union, name) for name in names]
                if not sum(r.numel() for r in rows):
                    continue
                theirs = [[self._rows_of(ids, name) for name in names] for ids in everyone]
                longest = max(sum(t.numel() for t in per_rank) for per_rank in theirs)
                if len(everyone) * longest * dim < 2 * sum(r.numel() for r in rows) * (dim + 1):
                    sums, counts = self._gathered_sums([sent.parts[i][2] for i in parts], rows, theirs, longest, group)
                else:
                    sums, counts = self._reduced_sums([sent.parts[i] for i in parts], rows, group)
                out += [(name, ids, total / n.sqrt()) for name, ids, total, n in zip(names, rows, sums, counts)
                        if ids.numel()]
        self.merged_rows += sum(ids.numel() for _, ids, _ in out)
        return out

    def _gathered_sums(self, mine: list[torch.Tensor], rows: list[torch.Tensor], theirs: list[list[torch.Tensor]],
                       longest: int, group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per table, ``Σ_r (w_r − b)`` over its union ``rows`` and how many ranks met each (n, as a column), from
        every rank's own updates all-gathered (``mine``: this rank's, per table, in the order of its rows)."""
        dim = mine[0].shape[1]
        own = torch.cat(mine)
        buf = torch.zeros(longest, dim, dtype=self.update_dtype, device="cpu")
        buf[:own.shape[0]] = own
        everyone = [torch.empty_like(buf) for _ in theirs]
        dist.all_gather(everyone, buf, group=group)
        sums = [torch.zeros(r.numel(), dim, device="cpu") for r in rows]
        counts = [torch.zeros(r.numel(), 1, device="cpu") for r in rows]
        for got, per_table in zip(everyone, theirs):
            at = 0
            for ids, union, total, n in zip(per_table, rows, sums, counts):
                where = torch.searchsorted(union, ids)
                total.index_add_(0, where, got[at:at + ids.numel()].float())
                n[where] += 1
                at += ids.numel()
        return sums, counts

    def _reduced_sums(self, parts: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], rows: list[torch.Tensor],
                      group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per table, ``Σ_r (w_r − b)`` over its union ``rows`` and how many ranks met each (n, as a column): one
        all-reduce of [update, 1] for every union row (zeros where this rank did not meet it)."""
        dim = parts[0][2].shape[1]
        bufs = []
        for (_, own, delta, _), ids in zip(parts, rows):
            buf = torch.zeros(ids.numel(), dim + 1, device="cpu")
            at = torch.searchsorted(ids, own)
            buf[at, :dim], buf[at, dim] = delta, 1.0
            bufs.append(buf)
        buf = torch.cat(bufs).to(self.update_dtype)
        dist.all_reduce(buf, group=group)  # [Σ_r (w_r − b), n]
        buf = buf.float()
        sums, counts, at = [], [], 0
        for ids in rows:
            sums.append(buf[at:at + ids.numel(), :dim])
            counts.append(buf[at:at + ids.numel(), dim:])
            at += ids.numel()
        return sums, counts

    @torch.no_grad()
    def add_late(self, sent: "TablePass", merged: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Apply a merge late (``trainer.merging.overlap``): every row gets the merged update and loses this rank's
        own update of that pass, which it already holds — ``w ← w + u − δ_own``, u the merged update — so what it
        learned since stays on top; the rows the pass under way already met get the same change to their ``b``."""
        for name, ids, update in merged:
            self.tables[name].index_add_(0, ids, update.to(self.tables[name].dtype))
            self._shift_bases(name, ids, update)
        for name, own, delta, _ in sent.parts:
            self.tables[name].index_add_(0, own, delta.to(self.tables[name].dtype), alpha=-1.0)
            self._shift_bases(name, own, -delta)

    def _shift_bases(self, name: str, ids: torch.Tensor, change: torch.Tensor) -> None:
        """Add ``change`` to the kept ``b`` of those of the rows ``ids`` (of ``name``, sorted) this pass met."""
        lo = self.first_row[name]
        for kept_ids, kept_rows in self._base.get(name, []):
            at = torch.searchsorted(ids, kept_ids - lo).clamp(max=max(ids.numel() - 1, 0))
            hit = ids[at] == kept_ids - lo if ids.numel() else torch.zeros_like(kept_ids, dtype=torch.bool)
            kept_rows[hit] += change[at[hit]].to(kept_rows.dtype)

    def _bases(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """``b`` of the rows ``ids`` (indices over all tables) of ``name``, in fp32: kept by :meth:`record` where this
        rank updated them, else the table's own (unchanged since the last merge)."""
        out = self.tables[name][ids - self.first_row[name]].float()
        kept = self._base.get(name)
        if kept:
            kept_ids = torch.cat([k for k, _ in kept])
            kept_rows = torch.cat([r for _, r in kept])
            order = torch.argsort(kept_ids)
            kept_ids, kept_rows = kept_ids[order], kept_rows[order]
            pos = torch.searchsorted(kept_ids, ids).clamp(max=kept_ids.numel() - 1)
            mine = kept_ids[pos] == ids
            out[mine] = kept_rows[pos[mine]].float()
        return out
