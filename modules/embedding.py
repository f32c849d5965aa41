"""The sparse side every model shares: one TorchRec EmbeddingBagCollection over all fields.

Per categorical field ``f`` the collection holds

* ``emb_<f>``: the field's embedding table (``embedding_dim`` columns), used by the FM / deep /
  cross parts and by CowClip;
* ``wide_<f>`` (optional): its first-order ("wide", linear) weights. FBGEMM kernels need a
  column count divisible by 4, so the table has 4 columns and only column 0 is used: exactly a
  scalar weight per id for element-wise optimizers (the other columns get zero gradient).

Both tables read the same KeyedJaggedTensor key ``f``; TorchRec names the pooled outputs of such
shared features ``f@table``. A sharded collection returns its outputs in sharding order, not config
order, so the outputs are selected by key (``KeyedTensor.regroup``), never by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from torch import nn
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType

from modules.cowclip import CowClipConfig, CowClipStats, apply_cowclip, one_hot_ids

WIDE_COLUMNS = 4
EMB_PREFIX = "emb_"
WIDE_PREFIX = "wide_"


@dataclass(frozen=True)
class FeatureSpec:
    """What a model needs to know about the data: field names and table sizes."""

    dense: tuple[str, ...]
    categorical: tuple[str, ...]
    table_sizes: dict[str, int]

    @classmethod
    def from_store_meta(cls, meta: dict) -> "FeatureSpec":
        return cls(tuple(meta["dense"]), tuple(meta["categorical"]),
                   {k: int(v) for k, v in meta["table_sizes"].items()})


def pooled_keys(tables: Sequence[EmbeddingBagConfig]) -> dict[str, list[str]]:
    """Output key of each table's pooled embedding (``f@table`` where ``f`` feeds several tables)."""
    uses: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            uses[f] = uses.get(f, 0) + 1
    return {t.name: [f"{f}@{t.name}" if uses[f] > 1 else f for f in t.feature_names] for t in tables}


def table_configs(spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool) -> list[EmbeddingBagConfig]:
    if embedding_dim % 4:
        raise ValueError(f"model.embedding_dim={embedding_dim}: FBGEMM kernels need a multiple of 4")
    normal = partial(nn.init.normal_, mean=0.0, std=init_std)
    tables = [EmbeddingBagConfig(name=EMB_PREFIX + f, embedding_dim=embedding_dim,
                                 num_embeddings=spec.table_sizes[f], feature_names=[f],
                                 pooling=PoolingType.SUM, init_fn=normal)
              for f in spec.categorical]
    if wide:
        tables += [EmbeddingBagConfig(name=WIDE_PREFIX + f, embedding_dim=WIDE_COLUMNS,
                                      num_embeddings=spec.table_sizes[f], feature_names=[f],
                                      pooling=PoolingType.SUM, init_fn=nn.init.zeros_)
                   for f in spec.categorical]
    return tables


class SparseArch(nn.Module):
    """Looks up all fields: returns embeddings ``[B, F, D]`` and first-order logits ``[B]`` (or None).

    ``set_local_cowclip`` makes it apply CowClip (and the per-id L2 term) to the listed tables on this
    rank's pooled outputs, i.e. over the rank's own batch ("local" scope).
    """

    def __init__(self, spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.num_fields = len(spec.categorical)
        self.embedding_dim = embedding_dim
        self.wide = wide
        tables = table_configs(spec, embedding_dim, init_std, wide)
        self.table_names = [t.name for t in tables]
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        keys = pooled_keys(tables)
        self._groups = [[k for f in spec.categorical for k in keys[EMB_PREFIX + f]]]
        if wide:
            self._groups.append([k for f in spec.categorical for k in keys[WIDE_PREFIX + f]])
        self._flat_keys = [k for g in self._groups for k in g]
        self._group_widths = [len(self._groups[0]) * embedding_dim] + ([len(self._groups[1]) * WIDE_COLUMNS] if wide else [])
        self.fields = list(spec.categorical)
        self._cowclip: CowClipConfig | None = None
        self._cowclip_tables: set[str] = set()
        self._cowclip_stats: CowClipStats | None = None

    def set_local_cowclip(self, cfg: CowClipConfig | None, tables: set[str], stats: CowClipStats | None = None) -> None:
        self._cowclip = cfg if cfg is not None and tables else None
        self._cowclip_tables = set(tables)
        self._cowclip_stats = stats

    def _local_cowclip(self, pooled: torch.Tensor, prefix: str, width: int, ids: torch.Tensor) -> torch.Tensor:
        blocks = [(j * width, (j + 1) * width, ids[j], self._cowclip.clips(prefix + f))
                  for j, f in enumerate(self.fields) if prefix + f in self._cowclip_tables]
        world = dist.get_world_size() if dist.is_initialized() else 1
        return apply_cowclip(pooled, blocks, self._cowclip, grad_scale=1.0 / world, l2_share=1.0 / world,
                             stats=self._cowclip_stats)

    def forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        pooled = self.ebc(features)
        if pooled.keys() == self._flat_keys:  # the groups are column ranges of the values: views, no copy
            groups = list(pooled.values().split(self._group_widths, dim=1))
        else:
            groups = KeyedTensor.regroup([pooled], self._groups)
        if self._cowclip is not None:
            ids = one_hot_ids(features)
            groups[0] = self._local_cowclip(groups[0], EMB_PREFIX, self.embedding_dim, ids)
            if self.wide:
                groups[1] = self._local_cowclip(groups[1], WIDE_PREFIX, WIDE_COLUMNS, ids)
        emb = groups[0].reshape(-1, self.num_fields, self.embedding_dim)
        if not self.wide:
            return emb, None
        first_order = groups[1].reshape(-1, self.num_fields, WIDE_COLUMNS)[..., 0].sum(dim=1)
        return emb, first_order


def is_embedding_table(name: str) -> bool:
    """True for the ``emb_<f>`` tables (the ones CowClip clips), false for ``wide_<f>``."""
    return name.startswith(EMB_PREFIX)


def categorical_tables(names: Sequence[str]) -> list[str]:
    return [n for n in names if is_embedding_table(n)]
