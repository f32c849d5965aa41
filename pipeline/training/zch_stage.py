"""``model.zch`` while training: raw ids become rows before the sharded model looks them up
(:class:`modules.embedding.zch.remapper.ZchRemapper`, a submodule of the task, so checkpoints hold its state), and rows that
change hands start afresh (:func:`modules.embedding.row_reset.reset_rows`; the every-row L2 owes them no decay)."""

from __future__ import annotations

from typing import Callable

from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor

from modules.embedding.sparse_arch import FeatureSpec
from modules.embedding.row_reset import reset_rows
from modules.embedding.sharded_kernels import kernels
from modules.embedding.zch.config import ZchConfig
from modules.embedding.zch.remapper import COUNTS, ZchRemapper
from pipeline.runtime.errors import ConfigError


def table_inits(net: nn.Module) -> dict[str, Callable]:
    """Physical table → its ``init_fn``, from an unsharded model's collections."""
    out = {}
    for m in net.modules():
        if isinstance(m, EmbeddingBagCollection):
            out.update({c.name: c.init_fn for c in m.embedding_bag_configs()})
        elif isinstance(m, EmbeddingCollection):
            out.update({c.name: c.init_fn for c in m.embedding_configs()})
    return out


def check_zch_model(model: nn.Module) -> None:
    """What the remapper and the row resets need of the sharded model; raises :class:`ConfigError`."""
    dense = [t.name for _, _, k in kernels(model) if isinstance(k.emb_module, DenseTableBatchedEmbeddingBagsCodegen)
             for t in k.config.embedding_tables]
    if dense:
        raise ConfigError(f"model.zch: tables {dense} are data-parallel, whose optimizer state the row reset cannot "
                          f"reach; use a fused embedding optimizer (optim.embedding.name=adagrad|rowwise_adagrad)")


class ZchStage(nn.Module):
    """The remapper of a run and what its evictions need (module docstring)."""

    def __init__(self, cfg: ZchConfig, spec: FeatureSpec, inits: dict[str, Callable], day: int) -> None:
        super().__init__()
        self.remapper = ZchRemapper.of(cfg, spec)
        self.remapper.set_day(day)
        self.spec, self.inits = spec, inits

    def forward(self, model: nn.Module, kjt: KeyedJaggedTensor, lazy_l2: object | None, time: int = -1) -> KeyedJaggedTensor:
        rows = self.remapper(kjt, time)
        for kernel, table, local in reset_rows(model, self.spec, self.inits, self.remapper.take_evicted()):
            if lazy_l2 is not None:
                lazy_l2.restart_rows(kernel, table, local)
        return rows

    def metrics(self) -> dict[str, float]:
        """Since the last call, over all tables and per table (``zch/<name>/<table>``), over every rank (every
        rank calls it): ids admitted and evicted, share of looked-up ids on the unknown row (new ids waiting for a
        round or turned away: MCH's fallback); occupancy now; and ``zch/mapping_mb``: the largest rank's share of
        the mapping."""
        per_table = self.remapper.take_counts()
        out = {"zch/mapping_mb": self.remapper.exchange.largest(self.remapper.mapping_bytes()) / 1e6}
        total = {k: sum(c[k] for c in per_table.values()) for k in COUNTS}
        total["occupancy"] = sum(c["occupancy"] for c in per_table.values()) / max(1, len(per_table))
        for t, c in [("", total), *per_table.items()]:
            at = f"/{t}" if t else ""
            out.update({f"zch/admitted{at}": float(c["admitted"]), f"zch/evicted{at}": float(c["evicted"]),
                        f"zch/unknown_share{at}": c["unknown"] / max(1, c["looked_up"]),
                        f"zch/occupancy{at}": float(c["occupancy"])})
        return out
