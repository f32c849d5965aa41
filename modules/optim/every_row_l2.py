"""``optim.embedding_l2_scope=all``: the L2 term 2λ·w on every row at every step, attached to a sharded
model (the two algorithms, dense and lazy, are :mod:`modules.optim.embedding_l2`).

The training loop drives it: :meth:`EveryRowL2.begin_step` before each step's forward,
:meth:`~EveryRowL2.after_backward` before the optimizers step, :meth:`~EveryRowL2.flush` before
anything reads the tables (validation, checkpoints, the end of training).
"""

from __future__ import annotations

from dataclasses import dataclass

from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import nn

from modules.optim.cowclip import CowClipConfig, CowClipStats, RowBuckets
from modules.embedding.sparse_arch import lookup_name
from modules.optim.embedding_l2 import DecayRule, DenseRowsL2, LazyRowsL2
from modules.embedding.sharded_kernels import kernel_layout, kernels


@dataclass
class EveryRowL2:
    dense: DenseRowsL2  # data-parallel tables: 2λW on the all-reduced gradient, every row clipped
    lazy: LazyRowsL2    # fused tables: the missed steps replayed at a row's next lookup

    def begin_step(self, step: int, embedding_lr: float) -> None:
        self.lazy.begin_step(step, embedding_lr)

    def after_backward(self) -> None:
        self.dense.apply()

    def flush(self) -> None:
        self.lazy.flush()


def attach_every_row_l2(model: nn.Module, rules: dict[str, bool], cfg: CowClipConfig, l2: float, decay: DecayRule,
                        stats: CowClipStats, buckets: RowBuckets | None) -> tuple[EveryRowL2, dict[str, bool]]:
    """The every-row L2 term on a DMP model: the dense version on data-parallel kernels (which then need no
    per-id hook: it clips too), the lazy one on fused kernels; returns it and the lookup ``rules``
    (:func:`modules.optim.cowclip_hooks.lookup_rules`) left to the per-id hooks."""
    if cfg.fields is not None:
        raise ValueError("optim.embedding_l2_scope=all applies to every table: scaling.cowclip.fields must be null")
    l2_term = EveryRowL2(DenseRowsL2(l2, cfg, stats), LazyRowsL2(decay))
    left = dict(rules)
    for _, _, kernel in kernels(model):
        layout = kernel_layout(kernel)
        if isinstance(kernel.emb_module, DenseTableBatchedEmbeddingBagsCodegen):
            l2_term.dense.add(kernel, {t.name for t in kernel.config.embedding_tables
                                        if any(rules.get(lookup_name(t.name, f)) for f in t.feature_names)}, buckets)
            for name, _, _ in layout:
                left.pop(name, None)
        else:
            l2_term.lazy.add(kernel)
    if l2_term.lazy.kernels and cfg.enabled and 2 * l2 > cfg.r:
        raise ValueError(f"optim.embedding_l2_scope=all: 2λ = {2 * l2:g} > scaling.cowclip.r = {cfg.r:g} (λ after "
                         f"scaling): an absent row's L2 step could be clipped, which the lazy replay does not do")
    return l2_term, left
