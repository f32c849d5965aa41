"""The ``model.zch`` mapping split over the ranks, and the ids' way to it and back.

*Units.* A table's ids fall into B = ``model.zch.buckets`` buckets by ``raw mod B`` (raw ids are splitmix64
hashes, :func:`pipeline.data.encoding.raw_ids`: their low bits are uniform). Bucket b of a table of N id rows
is one MCH module over rows ``FIRST_ROW + b·N/B …`` with its own admission and eviction — an LRU over N/B
rows, as a set of a set-associative cache. A (table, bucket) is a *unit*; each unit's mapping lives on one
rank, its *owner*: units are dealt largest first to the rank holding the fewest rows so far (ties: the lower
rank), so with B = world size every table is split evenly over the ranks. The units do not depend on the world
size, so one process and 2 ranks build the same mapping.

*A step* (as TorchRec's sharded managed-collision modules remap after their input all-to-all, here before the
sharded model's): every rank sends each unit's ids of its local batch to the unit's owner — one all-gather of
the sizes and the step's latest row time, one ``all_to_all_single`` of the ids (:meth:`Exchange.to_owners`);
the owner admits the global batch's ids (the ranks' ids one after the other: admission depends on the ids and
their counts, not on their order, so it is the mapping one process builds from the same global batches) and
maps them; the rows go back by the reverse ``all_to_all_single`` (:meth:`Exchange.back`). A rank holds the
mapping of its units only (16 bytes an id, and the probation list of its units).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modules.host_collectives import host_group


def bucket_of(raw: torch.Tensor, buckets: int) -> torch.Tensor:
    """The bucket of each raw id: ``raw mod buckets``."""
    return torch.remainder(raw, buckets)


def deal(rows: list[int], world: int) -> list[int]:
    """The owner rank of each unit of ``rows`` rows: largest first to the rank with the fewest rows so far
    (ties: the lower rank, then the unit listed first)."""
    load = [0] * world
    owner = [0] * len(rows)
    for u in sorted(range(len(rows)), key=lambda u: (-rows[u], u)):
        owner[u] = min(range(world), key=lambda r: (load[r], r))
        load[owner[u]] += rows[u]
    return owner


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Exchange:
    """Ids of every unit to their owner and rows back (module docstring); ``rows``: each unit's rows, by which
    the units are dealt to the ranks (:func:`deal`)."""

    def __init__(self, rows: list[int]) -> None:
        self.rank, self.world = _world()
        self.owners = owners = deal(rows, self.world)
        self.mine = [u for u, r in enumerate(owners) if r == self.rank]
        self._units_of = [[u for u, o in enumerate(owners) if o == r] for r in range(self.world)]
        self._sent_order = [u for units in self._units_of for u in units]  # by owner, then unit
        self._sizes = torch.zeros(0, device="cpu")

    def to_owners(self, per_unit: list[torch.Tensor], time: int = -1) -> tuple[list[torch.Tensor], int]:
        """(each unit of this rank's: the ids every rank sent for it, rank 0's first; the latest ``time`` of the
        ranks). ``per_unit``: this rank's ids of every unit."""
        if self.world == 1:
            return per_unit, time
        sizes = torch.tensor([*(len(v) for v in per_unit), time], dtype=torch.int64, device="cpu")
        gathered = [torch.empty_like(sizes) for _ in range(self.world)]
        dist.all_gather(gathered, sizes, group=host_group())
        latest = int(max(int(s[-1]) for s in gathered))
        self._sizes = torch.stack(gathered)[:, :-1]  # [source rank, unit]
        recv = self._all_to_all(torch.cat([per_unit[u] for u in self._sent_order]),
                                self._per_owner(self._sizes[self.rank]), self._from_each(self._sizes))
        n = len(self.mine)
        if not n:  # more ranks than units
            return [], latest
        pieces = torch.split(recv, self._sizes[:, self.mine].reshape(-1).tolist())  # [source][my unit]
        return [torch.cat(pieces[i::n]) for i in range(n)], latest

    def back(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows of :meth:`to_owners`' ids (``rows``: per unit of this rank's, in the order received) as this
        rank's ids of every unit, in the order sent."""
        if self.world == 1:
            return rows
        n = len(self.mine)
        per_source = [torch.split(r, self._sizes[:, u].tolist()) for r, u in zip(rows, self.mine)]
        send = torch.cat([per_source[i][s] for s in range(self.world) for i in range(n)]) if n else \
            torch.zeros(0, dtype=torch.int64, device="cpu")
        recv = self._all_to_all(send, self._from_each(self._sizes), self._per_owner(self._sizes[self.rank]))
        pieces = torch.split(recv, self._sizes[self.rank, self._sent_order].tolist())
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64, device="cpu")] * len(self.owners)
        for u, piece in zip(self._sent_order, pieces):
            out[u] = piece
        return out

    def summed(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks (every rank calls it)."""
        if self.world > 1:
            dist.all_reduce(values, group=host_group())
        return values

    def largest(self, value: int) -> int:
        """The largest of the ranks' ``value`` (every rank calls it)."""
        if self.world == 1:
            return value
        out = torch.tensor([value], dtype=torch.int64, device="cpu")
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=host_group())
        return int(out)

    def everyone(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, rank 0's first (every rank calls it)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=host_group())
        return out

    def to_first(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, None on the others (every rank calls it)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=host_group())
        return out

    def _per_owner(self, sizes: torch.Tensor) -> list[int]:
        """Ids of ``sizes`` (per unit) going to each rank."""
        return [int(sizes[units].sum()) for units in self._units_of]

    def _from_each(self, sizes: torch.Tensor) -> list[int]:
        """Ids of my units each rank sends (``sizes``: [source rank, unit])."""
        return [int(sizes[s, self.mine].sum()) for s in range(self.world)]

    @staticmethod
    def _all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device="cpu")
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                               group=host_group())
        return recv
