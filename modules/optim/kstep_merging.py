"""k-step model merging (Baidu PaddleBox; Zhao et al., "Communication-efficient TeraByte-scale model
training framework for online advertising", IEEE BigData 2022, arXiv 2201.05500).

Every worker runs its optimizer (Adam) locally on its own batches; every ``k`` steps the replicated
parameters — the dense network and data-parallel embedding tables; model-parallel embedding shards
have one owner and need no merging — are replaced by their mean over all workers:

    θ ← (1/W) Σ_r θ_r            (plain mean, learning rate untouched)

or, with the updates sent in half precision (``trainer.comms.dense=fp16|bf16``: half the bytes; an update
over k steps is small, and fp16 keeps ~11 bits of it where θ itself would lose its low bits),

    θ ← b + (1/W) Σ_r (θ_r − b)   (b: θ at the last merge over all ranks, equal everywhere)

optionally together with Adam's first and second moments m, v (``moments=True``).

Overlapped (``overlap=j``, 1 ≤ j ≤ k steps): a merge's bytes travel while the next j steps compute (on a thread of
its own: :mod:`modules.optim.in_flight`) and the mean lands j steps late. Each rank sends its own update of the pass
δ_r (θ_r at the merge minus θ_r at the last one, landed means excluded) and, when the mean arrives, trades its own
update for it:

    θ_r ← θ_r + (1/W) Σ_s δ_s − δ_r        (and the same to the pass's base, so its next δ_r stays its own)

so every rank holds the merged model of the landed passes plus its own steps since: up to k + j steps of staleness
instead of k. The final merge (below) waits for the merge in flight and merges the last pass at once: the
replicas then agree to float rounding (not bit for bit: each rank adds the means to its own sum). Hierarchical
variant: every ``k_intra`` steps the mean is taken inside each node, every ``k`` steps over all
workers (``k`` a multiple of ``k_intra``). A final merge happens at the end of each epoch and before
evaluation (:meth:`KStepMerger.merge`), and parameters start identical (broadcast from rank 0). A checkpoint merges
nothing: each rank saves what differs between ranks or what the next merges read (:meth:`KStepMerger.state_dict`),
so that the run with checkpoints, and one resumed from any of them, keep the bits of the run without. The averaging is ``torch.distributed.algorithms.model_averaging.utils.average_parameters``.

With SGD, merging every step (k = 1) is exactly synchronous data parallelism (the mean of the
locally updated parameters is the update with the mean gradient); with Adam it is not, since
the second moment is not linear in the gradient. Embedding tables with a copy on every rank or node
(``tables=replicated|per_node``) are merged at the same steps, row by row (:mod:`modules.optim.sparse_merging`),
each shard with the ranks that hold the same shard (``table_group``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from modules.comm_accounting import comm_category
from modules.optim.in_flight import InFlight
from modules.optim.sparse_merging import UPDATE_DTYPES, TableMerger, TablePass

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
TABLES = ("auto", "sharded", "replicated", "per_node")
DENSE_DTYPES = {**UPDATE_DTYPES, "bf16": torch.bfloat16}  # the tables' update precisions, and bf16


@dataclass
class MergeConfig:
    """``trainer.merging``; ``k`` None: synchronous data parallelism (no merging); ``auto`` (the default):
    chosen from the stated inter-node link (:mod:`modules.sharding.link_plan`), None until then. ``tables``:
    ``sharded`` (each table on one owner, looked up through the all-to-all), ``replicated`` (every table
    whole on every rank, its looked-up rows merged every ``k`` steps: :mod:`modules.optim.sparse_merging`),
    ``per_node`` (every table on every node, sharded over its ranks, synchronous inside the node and merged so
    across nodes) or ``auto`` (the default: sharded unless the stated link makes copies faster and they fit)."""

    k: Any = "auto"
    k_intra: Optional[int] = None
    moments: bool = False
    tables: str = "auto"
    overlap: Any = "auto"  # steps each merge's bytes travel while training goes on before it lands; auto: chosen
    #                        with the link (modules/sharding/link_plan.py), 0 where nothing resolves it

    def __post_init__(self) -> None:
        if self.tables not in TABLES:
            raise ValueError(f"tables={self.tables!r}: expected one of {TABLES}")
        if self.copies and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k_intra is not None):
            raise ValueError(f"tables={self.tables} with k={self.k!r}, k_intra={self.k_intra!r}: the tables' copies "
                             f"are merged every k steps; set an integer k (1 merges every step) and no k_intra")
        if self.overlap != "auto" and (isinstance(self.overlap, bool) or not isinstance(self.overlap, int)
                                       or self.overlap < 0):
            raise ValueError(f"overlap={self.overlap!r}: expected the steps a merge travels before it lands (0: none, "
                             f"up to k) or auto")
        if self.overlap != "auto" and self.overlap and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                                        or self.k_intra is not None or self.overlap > self.k):
            raise ValueError(f"overlap={self.overlap} with k={self.k!r}, k_intra={self.k_intra!r}: a merge travels "
                             f"while at most the next k steps train; set an integer k >= overlap and no k_intra")
        if self.k == "auto":
            if self.k_intra is not None:
                raise ValueError(f"k_intra={self.k_intra}: needs an integer k (k=auto is chosen from the link)")
            return
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"k={self.k!r}: expected an integer >= 1, null (no merging) or auto")
        if self.k_intra is not None and (self.k is None or self.k_intra < 1 or self.k % self.k_intra):
            raise ValueError(f"k_intra={self.k_intra}: expected a divisor of k={self.k}")

    @property
    def enabled(self) -> bool:
        return self.k not in (None, "auto")

    @property
    def copies(self) -> bool:
        """Whether every rank (``replicated``) or node (``per_node``) holds a copy of the tables, merged sparsely."""
        return self.tables in ("replicated", "per_node")


@dataclass
class DensePass:
    """One rank's part of an overlapped merge: its updates of the pass (fp32, kept) and the moments (if merged)."""

    updates: torch.Tensor
    moments: torch.Tensor | None


class KStepMerger:
    def __init__(self, params: Iterable[torch.nn.Parameter], cfg: MergeConfig,
                 ranks_per_node: int | None = None, tables: TableMerger | None = None, dense: str = "fp32",
                 timeout: timedelta | None = None, table_group: dist.ProcessGroup | None = None) -> None:
        self.params = [p for p in params]
        self.dense_dtype = DENSE_DTYPES[dense]  # what the dense part's updates travel in
        self.tables = tables  # this rank's shards of the tables' copies, merged sparsely with the dense part
        self.table_group = table_group  # the ranks holding the same shards (None: all), with ``timeout``
        self.cfg = cfg
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.merges = 0
        self.dirty = False
        self.node_group = None
        self.overlap = 0 if cfg.overlap == "auto" else cfg.overlap
        self.in_flight: InFlight | None = None  # an overlapped merge: its bytes travelling
        self.lands_at = 0  # the step after which it lands
        self.merge_group = dist.new_group(backend="gloo", timeout=timeout) if self.overlap else None
        world = dist.get_world_size()
        if cfg.k_intra is not None:
            per_node = ranks_per_node or world
            if world % per_node:
                raise ValueError(f"world size {world} is not a multiple of {per_node} ranks per node")
            self.node_group, _ = dist.new_subgroups(group_size=per_node, timeout=timeout)
        with torch.no_grad(), comm_category("merge"):
            for p in self.params:  # identical start on every rank
                dist.broadcast(p.data, src=0)
            if tables is not None:
                tables.make_equal(table_group)
        self._base = self._snapshot()

    def _snapshot(self) -> list[torch.Tensor]:
        """The replicated parameters at the last merge over all ranks: what updates are measured from when they
        travel in half precision (equal everywhere) or overlapped (each rank's own)."""
        return [p.detach().clone() for p in self.params] if self.dense_dtype != torch.float32 or self.overlap else []

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose Adam moments are merged with ``moments=True``."""
        self.optimizer = optimizer

    def _moments(self) -> list[torch.Tensor]:
        if not (self.cfg.moments and self.optimizer is not None):
            return []
        ids = {id(p) for p in self.params}
        out = []
        for p, state in self.optimizer.state.items():
            if id(p) in ids:
                out += [state[k] for k in MOMENT_KEYS if k in state and torch.is_tensor(state[k])]
        return out

    def merge(self, group: dist.ProcessGroup | None = None) -> None:
        """Average the replicated parameters (and moments) over ``group`` (default: all ranks)."""
        group = group or dist.group.WORLD
        half = self.dense_dtype != torch.float32
        tensors = (self.params if not half else []) + self._moments()
        with torch.no_grad(), comm_category("merge"):
            if tensors:
                average_parameters(iter(tensors), group)
            if half and self.params:
                self._merge_updates(group)
        if self.tables is not None:
            self.tables.merge(self.table_group or group)
        self.merges += 1
        if group is dist.group.WORLD:
            self.dirty = False
            self._base = self._snapshot()

    def _merge_updates(self, group: dist.ProcessGroup) -> None:
        """θ ← b + (1/W) Σ_r (θ_r − b), the updates θ_r − b sent in half precision (b: the last merge's θ)."""
        flat = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(self.params, self._base)]).to(self.dense_dtype)
        dist.all_reduce(flat, group=group)
        mean = flat.float() / dist.get_world_size(group)
        at = 0
        for p, b in zip(self.params, self._base):
            p.copy_(b + mean[at:at + p.numel()].view_as(p))
            at += p.numel()

    def after_step(self) -> bool:
        """Call after every optimizer step; merges when the schedule says so. Returns True if it did."""
        self.steps += 1
        self.dirty = True
        if self.in_flight is not None and self.steps >= self.lands_at:
            self._land()
        if self.steps % self.cfg.k == 0:
            self._launch() if self.overlap else self.merge()
            return True
        if self.node_group is not None and self.steps % self.cfg.k_intra == 0:
            self.merge(self.node_group)
            self.dirty = True  # replicas still differ across nodes
            return True
        return False

    def merge_if_dirty(self) -> None:
        """Final merge (end of epoch, before evaluation) unless nothing changed."""
        if self.overlap and (self.dirty or self.in_flight is not None):
            self._land()
            self._launch()
            self._land()  # the last pass at once: the replicas agree
            self.dirty = False
        elif self.dirty:
            self.merge()

    def state_dict(self, tables: bool = True) -> dict[str, Any]:
        """Everything that differs between ranks or that the next merges read, so that a run resumed from a checkpoint
        merges as the uninterrupted one does (a checkpoint merges nothing): this rank's replicated parameters, the
        updates' base, the tables' pass (:meth:`TableMerger.state_dict`; its shards with ``tables``) and a merge in
        flight, waited for (its bytes must have arrived: they are not sent again) and saved unlanded with the step
        it lands after. Live tensors, not copies: written at once."""
        state: dict[str, Any] = {"steps": self.steps, "merges": self.merges, "dirty": self.dirty,
                                 "params": [p.detach() for p in self.params], "base": self._base,
                                 "tables": self.tables.state_dict(tables) if self.tables is not None else None,
                                 "in_flight": None, "lands_at": self.lands_at}
        if self.in_flight is not None:
            dense, mean, moments, sent, rows = self.in_flight.result()
            state["in_flight"] = {
                "updates": dense.updates, "moments": dense.moments, "mean": mean, "mean_moments": moments,
                "sent": None if sent is None else {"ids": sent.ids, "parts": [list(part) for part in sent.parts]},
                "rows": None if rows is None else [list(r) for r in rows]}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``: after the parameters were loaded and made equal (each rank's
        own are put back) and before the next step."""
        self.steps, self.merges, self.dirty, self.lands_at = (int(state["steps"]), int(state["merges"]),
                                                              bool(state["dirty"]), int(state["lands_at"]))
        for p, saved in zip(self.params, state["params"], strict=True):
            p.copy_(saved)
        self._base = [b.clone() for b in state["base"]]
        if self.tables is not None:
            self.tables.load_state_dict(state["tables"])
        flight = state["in_flight"]
        self.in_flight = None if flight is None else InFlight.landed((
            DensePass(flight["updates"], flight["moments"]), flight["mean"], flight["mean_moments"],
            None if flight["sent"] is None else TablePass(flight["sent"]["ids"],
                                                          [tuple(part) for part in flight["sent"]["parts"]]),
            None if flight["rows"] is None else [tuple(r) for r in flight["rows"]]))

    @torch.no_grad()
    def _launch(self) -> None:
        """An overlapped merge: take this pass's updates and send them; it lands ``overlap`` steps later."""
        assert self.in_flight is None, "a merge lands before the next one leaves (overlap <= k)"
        sent = self._pass(), self.tables.snapshot() if self.tables is not None else None
        self._base = self._snapshot()
        self.in_flight = InFlight(self._exchange, *sent)
        self.lands_at = self.steps + self.overlap
        self.merges += 1

    def _pass(self) -> DensePass:
        updates = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(self.params, self._base)]) \
            if self.params else torch.zeros(0, device="cpu")
        moments = self._moments()
        return DensePass(updates, torch.cat([m.reshape(-1) for m in moments]) if moments else None)  # cat copies

    def _exchange(self, dense: DensePass, tables: TablePass | None) -> tuple:
        """Every rank's mean update and moments, and the tables' merged rows (on the merge's own thread)."""
        world = dist.get_world_size(self.merge_group)
        with torch.no_grad(), comm_category("merge"):
            mean = dense.updates.to(self.dense_dtype, copy=True)
            dist.all_reduce(mean, group=self.merge_group)
            moments = dense.moments.clone() if dense.moments is not None else None
            if moments is not None:
                dist.all_reduce(moments, group=self.merge_group)
        rows = self.tables.exchange(tables, self.table_group or self.merge_group) if tables is not None else None
        return dense, mean.float() / world, None if moments is None else moments / world, tables, rows

    @torch.no_grad()
    def _land(self) -> None:
        """Wait for the merge in flight and trade each rank's own updates of its pass for everyone's mean."""
        if self.in_flight is None:
            return
        dense, mean, moments, tables, rows = self.in_flight.result()
        self.in_flight = None
        change = mean - dense.updates
        _add_flat(self.params, change)
        _add_flat(self._base, change)  # the pass under way measures its updates from here
        if moments is not None:
            _add_flat(self._moments(), moments - dense.moments)
        if rows is not None:
            self.tables.add_late(tables, rows)


def _add_flat(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Add consecutive pieces of ``flat`` to ``tensors`` in place."""
    at = 0
    for t in tensors:
        t.add_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
