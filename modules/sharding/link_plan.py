"""The settings a stated inter-node link calls for: merge period k and communication precision, chosen by
the estimated step time.

Per rank and training step, the bytes that cross the link (W ranks, R per node, so a share
ρ = (W − R) / W of a rank's all-to-all partners and of a ring all-reduce's hops are on other nodes; tables
spread evenly over the ranks, table-wise):

    embedding = b · ρ · (w · (s_fwd + s_bwd) + f · 12)      b: local batch, w: pooled floats per sample
                                                             (Σ of the features' embedding dims), f: ids per
                                                             sample (int64 id + int32 length each)
    dense     = 2 · ρ · P · s_dense / k                      P: replicated parameters; DDP (k = 1, s_dense of
                                                             its hook) or k-step merging (the updates every k
                                                             steps, in s_dense)

With every table whole on every rank (``trainer.merging.tables=replicated``, :mod:`modules.optim.sparse_merging`)
no pooled vector crosses the link; every k steps the rows a pass met do:

    embedding = ρ · (4 · u_k + s_bwd · min(2 · U_k · (d + 1), W · u_k · d)) / k
                                                             u_k: distinct rows of k local batches (their
                                                             int32 ids all-gathered), U_k: of all ranks' k
                                                             batches; the updates travel in fp32 or fp16 (the
                                                             option's embedding_backward), all-reduced with a
                                                             count over U_k or each rank's own all-gathered,
                                                             whichever moves fewer (modules/optim/sparse_merging.py);
                                                             d: floats a row holds

With every table on every node, sharded over the node's ranks (``per_node``), only the nodes' copies are merged:
each rank exchanges its shard's part with the rank holding the same shard on each other node (N = W / R nodes),

    embedding = (N − 1)/N · (4 · u_k + s_bwd · min(2 · U_k · (d + 1), N · u_k · d)) / (k · R)
                                                             u_k: distinct rows of a node's k
                                                             batches (R ranks' local batches); R = 1 is the
                                                             replicated formula

and the pooled all-to-all stays inside the node (not counted: it crosses no link).

s_* are bytes per value (fp32 4, fp16/bf16 2). The step time is estimated without overlap:

    t(option) = t_compute + (embedding + dense) / link bandwidth

``t_compute`` is measured by the caller (the dense network's forward and backward at the local batch).
Options: k ∈ {DDP, 2, 4, 8} × embedding comms {fp32, fp16 forward + bf16 backward (fp16 on CPU)} × the dense
all-reduce or merge in {fp32, fp16}, and copies of the tables (replicated, and per node with more than one rank
a node) at k ∈ {2, 4, 8} with fp32 or fp16 updates (tables and dense part) where the caller measured the pass rows
(a node's share of the tables fits in each rank's memory and nothing else refuses copies). The fastest is taken
when it saves at least ``min_gain`` of the step against today's default (DDP, fp32); else the default stays, so a fast link or one node changes nothing. k ≤ 8 and these precisions are what was
measured within 0.001 test AUC of DDP (docs/kstep_merging.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from modules.sharding.comm_precision import BYTES

ID_BYTES = 12
MERGE_PERIODS = (None, 2, 4, 8)
# k-step merging over a stated link: each merge lands this many steps after it leaves, its bytes travelling
# meanwhile (trainer.merging.overlap=auto). Measured on 2 nodes at 100 Mbit/s (docs/kstep_merging.md): 2 steps gave
# sync merging's AUC at 1.17x its samples/s; 4 and 8 (more staleness) lost AUC; 1 hid less of the link.
LATE_STEPS = 2


@dataclass(frozen=True)
class StepShape:
    """What one rank's training step sends: its batch, pooled width, ids per sample, replicated parameters."""

    local_batch: int
    pooled_width: int
    ids_per_sample: int
    dense_params: int
    world: int
    ranks_per_node: int
    pass_rows: Optional["PassRows"] = None  # None: the tables cannot be replicated
    copies: tuple[str, ...] = ("replicated", "per_node")  # the kinds of copies the memory holds (with pass_rows)

    @property
    def remote_share(self) -> float:
        return (self.world - self.ranks_per_node) / self.world if self.world > 1 else 0.0


@dataclass(frozen=True)
class PassRows:
    """Distinct (table, row) pairs a pass of k steps meets, by k: on one rank (``local``), on one node's ranks
    (``node``; empty: as ``local``) and on all ranks together (``union``); ``row_floats``: the floats a looked-up
    row holds, on average over the lookups."""

    local: Mapping[int, int] = field(default_factory=dict)
    union: Mapping[int, int] = field(default_factory=dict)
    row_floats: float = 0.0
    node: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkOption:
    k: Optional[int]            # None: DDP
    embedding_forward: str
    embedding_backward: str
    dense: str                  # DDP's all-reduce precision, or the k-step merges' updates
    tables: str = "sharded"     # replicated / per_node: a copy on every rank / node, its met rows merged every k steps

    def describe(self) -> str:
        merge = "DDP" if self.k is None else f"k={self.k}"
        if self.tables != "sharded":
            return f"{merge}, tables {self.tables.replace('_', ' ')}, updates {self.embedding_backward}"
        return (f"{merge}, embeddings {self.embedding_forward}/{self.embedding_backward} (forward/backward), "
                f"dense {self.dense}")


DEFAULT = LinkOption(None, "fp32", "fp32", "fp32")


def link_bytes(shape: StepShape, option: LinkOption) -> dict[str, float]:
    """Bytes per rank and step across the link, by kind (the module docstring's formulas)."""
    rho = shape.remote_share
    dense = 2 * rho * shape.dense_params * BYTES[option.dense] / (option.k or 1)
    if option.tables != "sharded":
        rows = shape.pass_rows
        assert rows is not None and option.k is not None, "copies of the tables need the pass rows and a period"
        d, union = rows.row_floats, rows.union[option.k]
        if option.tables == "replicated":
            copies, met, share, span = shape.world, rows.local[option.k], rho, 1
        else:
            copies, span = shape.world // shape.ranks_per_node, shape.ranks_per_node
            met, share = (rows.node or rows.local)[option.k], (copies - 1) / copies
        updates = BYTES[option.embedding_backward] * min(2 * union * (d + 1), copies * met * d)  # the cheaper exchange
        return {"embedding": share * (4 * met + updates) / (option.k * span), "dense": dense}
    per_value = BYTES[option.embedding_forward] + BYTES[option.embedding_backward]
    embedding = shape.local_batch * rho * (shape.pooled_width * per_value + shape.ids_per_sample * ID_BYTES)
    return {"embedding": embedding, "dense": dense}


def options(half_backward: str = "bf16", copies: tuple[str, ...] = ()) -> list[LinkOption]:
    """Every option; ``half_backward``: the gradients' precision of the reduced option (fp16 on CPU, where
    TorchRec sends bf16 as fp16); ``copies``: also those with these copies of the tables (replicated: on every rank,
    per_node: on every node)."""
    out = []
    for k in MERGE_PERIODS:
        for forward, backward in (("fp32", "fp32"), ("fp16", half_backward)):
            for dense in ("fp32", "fp16"):
                out.append(LinkOption(k, forward, backward, dense))
    return out + [LinkOption(k, "fp32", updates, dense, tables) for tables in ("replicated", "per_node")
                  for k in MERGE_PERIODS[1:] for updates in ("fp32", "fp16") for dense in ("fp32", "fp16")
                  if tables in copies]


@dataclass(frozen=True)
class LinkChoice:
    option: LinkOption
    step_s: float             # estimated step time with it
    default_step_s: float     # with DDP in fp32
    compute_s: float
    bytes_per_step: float
    reason: str


def choose(shape: StepShape, link_gbytes_per_s: Optional[float], compute_s: float, min_gain: float = 0.10,
           fixed: Optional[dict] = None, half_backward: str = "bf16") -> LinkChoice:
    """The option of least estimated step time, or :data:`DEFAULT` unless it saves ``min_gain`` of the step.
    ``fixed``: fields a user set (``{"k": None}``, ``{"embedding_forward": "fp32"}``, ...): only options with
    those values are considered, so the rest is chosen around them."""
    fixed = fixed or {}

    def estimate(o: LinkOption) -> tuple[float, float]:
        sent = sum(link_bytes(shape, o).values())
        return compute_s + (sent / (link_gbytes_per_s * 1e9) if link_gbytes_per_s else 0.0), sent

    default_t, default_bytes = estimate(DEFAULT)
    if shape.remote_share == 0 or not link_gbytes_per_s:
        why = "one node" if shape.remote_share == 0 else "no inter-node bandwidth stated"
        return LinkChoice(DEFAULT, default_t, default_t, compute_s, default_bytes, why)
    candidates = [o for o in options(half_backward, shape.copies if shape.pass_rows is not None else ())
                  if all(getattr(o, key) == value for key, value in fixed.items())]
    best = min(candidates or [DEFAULT], key=lambda o: estimate(o)[0])
    best_t, best_bytes = estimate(best)
    if best_t > (1 - min_gain) * default_t:
        return LinkChoice(DEFAULT, default_t, default_t, compute_s, default_bytes,
                          f"the link adds {default_t - compute_s:.3f} s to a {compute_s:.3f} s step: less than "
                          f"{min_gain:.0%} to gain")
    return LinkChoice(best, best_t, default_t, compute_s, best_bytes,
                      f"{default_bytes / 1e6:.2f} MB a step at {link_gbytes_per_s:g} GB/s would take "
                      f"{default_t - compute_s:.3f} s beside {compute_s:.3f} s of compute")
