"""``trainer.merging.k`` and ``trainer.comms`` left at ``auto``, resolved for this run's link.

With more than one node and ``topology.bandwidth_gbps.inter_node`` stated (gigabytes per second, like
every ``bandwidth_gbps`` key: 100 Mbit/s is 0.0125), :func:`modules.sharding.link_plan.choose` picks the
merge period and the precisions of least estimated step time from the model's shape and the measured
compute time of its dense network (forward and backward of the MLP at the local batch, the slowest rank's,
so every rank takes the same choice). Values set explicitly are kept; ``auto`` with one node or no stated
link is today's default: DDP in fp32. Resolved after the process group exists (the model's
``configure_model``); a resumed run decides again.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from modules.embedding.feature_spec import FeatureSpec
from modules.embedding.sparse_arch import is_table_parameter
from modules.host_collectives import host_group
from modules.models import ModelConfig
from modules.optim.kstep_merging import MergeConfig
from modules.optim.optimizers import is_fusable
from modules.sharding.comm_precision import CommsConfig
from modules.sharding.link_plan import LATE_STEPS, MERGE_PERIODS, LinkChoice, PassRows, StepShape, choose
from modules.sharding.replicated_tables import copy_group
from modules.sharding.topology import GB, TopologySpec
from pipeline.config import RunConfig
from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import ConfigError


def replication_refused(run: RunConfig) -> str | None:
    """Why this run's tables cannot have copies (the setting that refuses it, and why), or None."""
    if run.topology.compute_device == "cuda":
        return "topology.compute_device=cuda: the merges' bookkeeping of looked-up rows is host-side (not on CUDA yet)"
    if run.model.zch.enabled:
        return "model.zch: its id mapping is each rank's own"
    if not is_fusable(run.optim.embedding, run.topology.compute_device):  # DENSE kernels: data-parallel parameters
        return (f"optim.embedding.name={run.optim.embedding.name}: not fused into FBGEMM's kernels on the CPU, its "
                f"tables become data-parallel parameters, which the dense merge would average whole and the row merge "
                f"again; use rowwise_adagrad, adagrad or sgd")
    if run.optim.embedding_l2_scope == "all":
        return ("optim.embedding_l2_scope=all: it changes rows no rank looked up, which the merge takes as equal "
                "everywhere")
    return None


def check_link_settings(run: RunConfig) -> None:
    """Refuse ``trainer.merging`` / ``trainer.comms`` settings the run cannot honour (:class:`ConfigError`)."""
    comms, merging = run.trainer.comms, run.trainer.merging
    bf16 = [k for k in ("embedding_forward", "embedding_backward") if getattr(comms, k) == "bf16"]
    if bf16 and run.topology.compute_device == "cpu":  # torchrec/distributed/fbgemm_qcomm_codec.py falls back
        raise ConfigError(f"trainer.comms.{bf16[0]}=bf16: TorchRec sends bf16 as fp16 on CPU (gloo): use fp16")
    if run.topology.compute_device == "cuda" and merging.overlap not in ("auto", 0):
        raise ConfigError(f"trainer.merging.overlap={merging.overlap} with topology.compute_device=cuda: a merge in "
                          f"flight travels over a gloo group of its own, which takes host tensors; set it to 0")
    if not merging.copies:
        return
    sent = [f"{key}={value}" for key, value, allowed in
            (("embedding_forward", comms.embedding_forward, ("auto", "fp32")),
             ("embedding_backward", comms.embedding_backward, ("auto", "fp32", "fp16"))) if value not in allowed]
    why = (f"trainer.comms.{sent[0]}: copies of the tables send no all-to-all across the link (their merges send "
           f"updates in embedding_backward: fp32 or fp16)") if sent else replication_refused(run)
    if why:
        raise ConfigError(f"trainer.merging.tables={merging.tables} with {why}; use trainer.merging.tables=sharded")


def dense_step_seconds(model: ModelConfig, spec: FeatureSpec, local_batch: int, repeats: int = 3,
                       device: torch.device = torch.device("cpu")) -> float:
    """Forward and backward of the model's MLP at ``local_batch`` rows on ``device`` (the fastest of ``repeats``;
    on CUDA each timed to the kernels' end, not their launch)."""
    width = len(spec.dense) + len(spec.sparse) * model.embedding_dim
    layers: list[nn.Module] = []
    for out in [*model.mlp, 1]:
        layers += [nn.Linear(width, out, device=device), nn.ReLU()]
        width = out
    mlp = nn.Sequential(*layers[:-1])
    x = torch.randn(local_batch, len(spec.dense) + len(spec.sparse) * model.embedding_dim, device=device)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        mlp(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first one warms up
            best = min(best, time.perf_counter() - start)
    return best


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (this value without a process group)."""
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return float(t.item())


def pass_rows(train: SplitArrays, spec: FeatureSpec, local_batch: int, world: int, row_floats: float,
              periods: tuple[int, ...] = MERGE_PERIODS[1:], seed: int = 0, ranks_per_node: int = 1) -> PassRows:
    """Distinct (table, row) pairs in a random sample of k local batches (one rank's pass), of k batches on each of
    a node's ranks (``ranks_per_node``) and of k batches on every rank (all ranks' pass) of the training split, for
    each k in ``periods`` (the same sample on every rank: the same choice everywhere). One-id features only
    (sequences are not counted)."""
    rng = np.random.default_rng(seed)
    n = len(train)
    order = rng.permutation(n)[:min(n, max(periods) * local_batch * world)]
    sample = np.asarray(train.sparse[np.sort(order)])[np.argsort(np.argsort(order))]  # memory maps read in order
    tables = [spec.table_of(f) for f in spec.categorical]
    offset = dict(zip(dict.fromkeys(tables), np.cumsum([0] + [spec.table_sizes[t] for t in dict.fromkeys(tables)])))
    rows = sample.astype(np.int64) + np.array([offset[t] for t in tables])  # one index over all tables

    def distinct(m: int) -> int:
        return int(np.unique(rows[:m]).size)

    return PassRows({k: distinct(k * local_batch) for k in periods},
                    {k: distinct(k * local_batch * world) for k in periods}, row_floats,
                    {k: distinct(k * local_batch * ranks_per_node) for k in periods})


def _table_bytes(net: nn.Module) -> float:
    """The tables' weights in bytes (fp32)."""
    return sum(p.numel() * 4 for name, p in net.named_parameters() if is_table_parameter(name))


def copies_that_fit(net: nn.Module, topology: TopologySpec) -> tuple[str, ...]:
    """The copies of the tables a rank's share of its tier's memory holds (the host's on CPU, shared by a node's
    ranks; the GPU's on CUDA; a topology without a capacity: all), each table with an optimizer state as large:
    ``replicated`` (every table whole on every rank: 2·T) and ``per_node`` (a node's copy split over its ranks:
    2·T / ranks per node)."""
    per_node, tables = topology.ranks_per_node or 1, _table_bytes(net)
    budget = (topology.hbm_cap_gb * (1 - topology.hbm_reserve) if topology.compute_device == "cuda"
              else topology.ddr_cap_gb * (1 - topology.ddr_reserve) / per_node) * GB
    need = {"replicated": 2 * tables, "per_node": 2 * tables / per_node}
    return tuple(kind for kind, size in need.items() if not budget or size <= budget)


def memory_refusal(merging: MergeConfig, net: nn.Module, topology: TopologySpec) -> str | None:
    """Why the copies ``trainer.merging.tables`` asks for do not fit (None: they do, or it asks for none)."""
    if not merging.copies or merging.tables in copies_that_fit(net, topology):
        return None
    tables = _table_bytes(net) / GB
    each = tables if merging.tables == "replicated" else tables / (topology.ranks_per_node or 1)
    return (f"trainer.merging.tables={merging.tables}: each rank would hold {2 * each:.2f} GB of tables and optimizer "
            f"state, more than its share of topology.{'hbm' if topology.compute_device == 'cuda' else 'ddr'}_cap_gb "
            f"after the reserve; use per_node or sharded")


def resolve_link(merging: MergeConfig, comms: CommsConfig, model: ModelConfig, spec: FeatureSpec,
                 topology: TopologySpec, local_batch: int, dense_params: int, rows: PassRows | None = None,
                 copies: tuple[str, ...] = ("replicated", "per_node")) -> tuple[MergeConfig, CommsConfig, LinkChoice]:
    """``merging`` and ``comms`` with every ``auto`` resolved, and the choice behind them (to print and log).
    ``rows``: what a pass meets, where the tables may be replicated (else only sharded options); ``copies``: the
    kinds of copies that fit in memory."""
    world = topology.world_size
    shape = StepShape(local_batch, len(spec.sparse) * model.embedding_dim, len(spec.sparse), dense_params, world,
                      topology.ranks_per_node or world, rows if merging.tables != "sharded" else None, copies)
    link = topology.bandwidth_gbps.inter_node
    needed = merging.k == "auto" or not comms.resolved or merging.tables == "auto"
    on_gpu = topology.compute_device == "cuda" and torch.cuda.is_available()  # (ctr plan of a GPU topology: the CPU)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    compute = slowest(dense_step_seconds(model, spec, local_batch, device=device)) \
        if needed and shape.remote_share and link else 0.0
    fixed = {key: value for key, value in (("k", merging.k), ("embedding_forward", comms.embedding_forward),
                                           ("embedding_backward", comms.embedding_backward), ("dense", comms.dense),
                                           ("tables", merging.tables))
             if value != "auto"}
    choice = choose(shape, link, compute, fixed=fixed,
                    half_backward="fp16" if topology.compute_device == "cpu" else "bf16")  # TorchRec: no bf16 on gloo
    o = choice.option
    k = o.k if merging.k == "auto" else merging.k
    late = min(LATE_STEPS, k) if (k and shape.remote_share and link and merging.k_intra is None
                                  and topology.compute_device == "cpu") else 0  # overlap: CPU only (check_link_settings)
    merging = replace(merging, k=k, tables=o.tables if merging.tables == "auto" else merging.tables,
                      overlap=late if merging.overlap == "auto" else merging.overlap)
    comms = CommsConfig(*(o_value if value == "auto" else value for value, o_value in
                          ((comms.embedding_forward, o.embedding_forward),
                           (comms.embedding_backward, o.embedding_backward), (comms.dense, o.dense))))
    return merging, comms, choice


@dataclass(frozen=True)
class LinkSettings:
    """A run's ``trainer.merging`` and ``trainer.comms``, and the choice that resolved their ``auto`` (None before)."""

    merging: MergeConfig
    comms: CommsConfig
    choice: Optional[LinkChoice] = None
    replicable: bool = True  # whether nothing else refuses copies of the tables (:func:`replication_refused`)
    ranks_per_node: int = 1
    timeout: timedelta = timedelta(minutes=10)  # trainer.collective_timeout_s: the copies' process groups wait so long

    @classmethod
    def of(cls, run: RunConfig) -> "LinkSettings":
        """A run's settings, ``auto`` still unresolved."""
        return cls(run.trainer.merging, run.trainer.comms, replicable=replication_refused(run) is None,
                   timeout=timedelta(seconds=run.trainer.collective_timeout_s))

    def resolved(self, model: ModelConfig, spec: FeatureSpec, net: nn.Module, topology: TopologySpec,
                 global_batch: int, train: SplitArrays | None = None) -> "LinkSettings":
        """Resolved for ``net`` (on any device; its non-table parameters are the replicated ones) on ``topology``.
        ``train``: the training split, whose passes the replicated tables' bytes are estimated from (None, or
        not ``replicable``: only sharded tables are considered for ``trainer.merging.tables=auto``)."""
        local_batch, per_node = global_batch // topology.world_size, topology.ranks_per_node or 1
        dense_params = sum(p.numel() for name, p in net.named_parameters() if not is_table_parameter(name))
        if (why := memory_refusal(self.merging, net, topology)) is not None:
            raise ConfigError(why)
        rows, fit = None, copies_that_fit(net, topology)
        if (train is not None and self.replicable and self.merging.tables != "sharded"
                and topology.world_size > 1 and topology.bandwidth_gbps.inter_node and fit):
            rows = pass_rows(train, spec, local_batch, topology.world_size, model.embedding_dim + bool(model.wide),
                             ranks_per_node=per_node)
        merging, comms, choice = resolve_link(self.merging, self.comms, model, spec, topology, local_batch,
                                              dense_params, rows, fit)
        if merging.copies:  # no all-to-all across the link; the backward's precision is the updates' in a merge
            comms = CommsConfig("fp32", comms.embedding_backward, comms.dense)
        return LinkSettings(merging, comms, choice, self.replicable, per_node, self.timeout)

    def record(self) -> dict[str, Any]:
        """The resolved settings as a checkpoint keeps them (:meth:`as_recorded` takes them back)."""
        return {"merging": asdict(self.merging), "comms": asdict(self.comms)}

    def as_recorded(self, recorded: dict[str, Any], topology: TopologySpec) -> "LinkSettings":
        """These settings as a checkpoint recorded them resolved, on ``topology`` (as run): a resumed run goes on as it
        ran, not as a new timing of the link would choose (``auto`` is decided from a measured compute time). An
        explicit value that differs from the checkpoint's is refused."""
        merging, comms = MergeConfig(**recorded["merging"]), CommsConfig(**recorded["comms"])
        for key, asked, ran in [*((f"merging.{k}", getattr(self.merging, k), getattr(merging, k))
                                  for k in ("k", "k_intra", "moments", "tables", "overlap")),
                                *((f"comms.{k}", getattr(self.comms, k), getattr(comms, k))
                                  for k in ("embedding_forward", "embedding_backward", "dense"))]:
            if asked not in ("auto", ran):
                raise ConfigError(f"trainer.{key}={asked!r}: the checkpoint being resumed ran with {ran!r}; resume with "
                                  f"it (or auto), or start a new run")
        return replace(self, merging=merging, comms=comms, choice=None, ranks_per_node=topology.ranks_per_node or 1)

    @property
    def copy_span(self) -> int:
        """The ranks one copy of the tables spans: 1 (``replicated``), a node's (``per_node``); 0: no copies."""
        if not (self.merging.enabled and self.merging.copies):
            return 0
        return 1 if self.merging.tables == "replicated" else self.ranks_per_node

    @property
    def dense_in_ddp(self) -> bool:
        """Whether DDP keeps the dense part synchronous: over all ranks without merging, and over a node's ranks with
        tables per node (merged across nodes); merging alone (replicated tables, sharded ones) averages it itself."""
        return not self.merging.enabled or self.copy_span > 1

    def shard_group(self) -> dist.ProcessGroup | None:
        """The process group the tables are sharded over, which is also the one a training step's collectives span
        (the all-to-all, DDP's all-reduce): this rank's own (``replicated``: every table whole here), its node's
        (``per_node``), else all ranks (None). Between merges the ranks of different groups share no collective."""
        return copy_group(self.copy_span, self.timeout) if self.copy_span else None

    def describe(self) -> str:
        """One line for the log and ``ctr plan``: what runs, and why."""
        merging, comms, choice = self.merging, self.comms, self.choice
        late = f", each merge travelling during the next {merging.overlap} steps" if merging.overlap else ""
        merge = "DDP (every step)" if merging.k is None else f"k-step merging, k={merging.k}{late}"
        if merging.copies:
            where = ("every table whole on every rank" if merging.tables == "replicated" else
                     f"every table on every node, sharded over its {self.ranks_per_node} ranks (all-to-all and DDP "
                     f"inside the node)")
            line = (f"link: {where}, the rows each copy looked up merged with the dense part every k={merging.k} "
                    f"steps{late}, updates in {comms.embedding_backward} (no embedding all-to-all across the link); "
                    f"dense updates {comms.dense}.")
        else:
            line = (f"link: {merge}; embedding all-to-all {comms.embedding_forward} forward, "
                    f"{comms.embedding_backward} backward; dense {'all-reduce' if merging.k is None else 'updates'} "
                    f"{comms.dense}.")
        estimated = choice is not None and choice.default_step_s > 0  # (one node: nothing crosses a link)
        return line + (f" Estimated step {choice.step_s:.3f} s against {choice.default_step_s:.3f} s with DDP in "
                       f"fp32 ({choice.reason})" if estimated else "")

    def params(self) -> dict[str, Any]:
        """What ran for the link (MLflow parameters ``link/*``): the merge period, precisions, estimates."""
        c = self.choice
        return {"link/merging_k": "null" if self.merging.k is None else self.merging.k,
                "link/tables": self.merging.tables, "link/overlap": self.merging.overlap,
                "link/embedding_forward": self.comms.embedding_forward,
                "link/embedding_backward": self.comms.embedding_backward, "link/dense": self.comms.dense,
                **({"link/estimated_step_s": round(c.step_s, 4), "link/estimated_ddp_fp32_step_s": round(c.default_step_s, 4),
                    "link/measured_dense_compute_s": round(c.compute_s, 4), "link/reason": c.reason[:400]} if c else {})}

