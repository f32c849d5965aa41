"""The sparse side every model shares: one TorchRec EmbeddingBagCollection over all fields.

Per categorical field ``f`` the collection holds

* ``emb_<f>``: the field's embedding table (``embedding_dim`` columns), read by the KJT key ``f``
  and used by the FM / deep / cross parts and by CowClip;
* (optional) the field's first-order ("wide", linear) weights: rows ``[o_f, o_f + n_f)`` of one
  table ``wide`` shared by all fields, read by the key ``wide_<f>`` whose ids are the field's ids
  shifted by ``o_f`` (:func:`wide_row_offsets`; :meth:`SparseArch.forward` adds these keys). FBGEMM
  kernels need a column count divisible by 4, so the table has 4 columns and only column 0 is used:
  exactly a scalar weight per id for element-wise optimizers (the other columns get zero gradient).

Why one wide table rather than one per field: every id is looked up, gradient-sorted and updated by
the embedding backward once per table it feeds; on CPU, FBGEMM's row-wise Adagrad backward takes
≈ 19 ms for 26 four-column tables at batch 8,192 and ≈ 9 ms for the same lookups as 26 features
of one table (benchmarks in docs/throughput.md). The update of a row is the same either way: each
row belongs to one field.

CowClip and the per-id L2 term work per *lookup* — ``emb_<f>`` or ``wide_<f>`` — whatever table it
reads (:attr:`SparseArch.lookup_names`, :func:`lookup_name`). A sharded collection returns its
outputs in sharding order, not config order, so the outputs are selected by key
(``KeyedTensor.regroup``), never by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType

from modules.cowclip import CowClipConfig, CowClipStats, apply_cowclip, one_hot_ids

WIDE_COLUMNS = 4
EMB_PREFIX = "emb_"
WIDE_PREFIX = "wide_"
WIDE_TABLE = "wide"


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


def wide_row_offsets(spec: FeatureSpec) -> dict[str, int]:
    """First row of each field's first-order weights in the shared ``wide`` table (fields in order)."""
    offsets, row = {}, 0
    for f in spec.categorical:
        offsets[f] = row
        row += spec.table_sizes[f]
    return offsets


def field_of(feature: str) -> str:
    """The categorical field a KJT key reads: ``f`` for ``f`` and for ``wide_<f>``."""
    return feature[len(WIDE_PREFIX):] if feature.startswith(WIDE_PREFIX) else feature


def lookup_name(table: str, feature: str) -> str:
    """The lookup a (table, KJT key) pair makes: the table's name, or ``wide_<f>`` in the shared table."""
    return feature if table == WIDE_TABLE else table


def table_configs(spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool) -> list[EmbeddingBagConfig]:
    if embedding_dim % 4:
        raise ValueError(f"model.embedding_dim={embedding_dim}: FBGEMM kernels need a multiple of 4")
    normal = partial(nn.init.normal_, mean=0.0, std=init_std)
    tables = [EmbeddingBagConfig(name=EMB_PREFIX + f, embedding_dim=embedding_dim,
                                 num_embeddings=spec.table_sizes[f], feature_names=[f],
                                 pooling=PoolingType.SUM, init_fn=normal)
              for f in spec.categorical]
    if wide:
        clash = [f for f in spec.categorical if f.startswith(WIDE_PREFIX)]
        if clash:
            raise ValueError(f"categorical fields {clash}: names starting with {WIDE_PREFIX!r} are reserved for the "
                             "first-order lookups")
        tables.append(EmbeddingBagConfig(name=WIDE_TABLE, embedding_dim=WIDE_COLUMNS,
                                         num_embeddings=sum(spec.table_sizes[f] for f in spec.categorical),
                                         feature_names=[WIDE_PREFIX + f for f in spec.categorical],
                                         pooling=PoolingType.SUM, init_fn=nn.init.zeros_))
    return tables


class SparseArch(nn.Module):
    """Looks up all fields: returns embeddings ``[B, F, D]`` and first-order logits ``[B]`` (or None).

    Takes a KeyedJaggedTensor keyed by the categorical fields. ``set_local_cowclip`` makes it apply
    CowClip (and the per-id L2 term) to the listed lookups on this rank's pooled outputs, i.e. over the
    rank's own batch ("local" scope).
    """

    def __init__(self, spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.num_fields = len(spec.categorical)
        self.embedding_dim = embedding_dim
        self.wide = wide
        self.fields = list(spec.categorical)
        self.ebc = EmbeddingBagCollection(tables=table_configs(spec, embedding_dim, init_std, wide), device=device)
        self._wide_keys = [WIDE_PREFIX + f for f in self.fields] if wide else []
        self._groups = [self.fields] + ([self._wide_keys] if wide else [])
        self._flat_keys = self.fields + self._wide_keys  # pooled output keys in group order
        self.lookup_names = [EMB_PREFIX + f for f in self.fields] + self._wide_keys
        self._group_widths = [self.num_fields * embedding_dim] + ([self.num_fields * WIDE_COLUMNS] if wide else [])
        offsets = wide_row_offsets(spec)
        self._wide_dtype = torch.int64 if sum(spec.table_sizes[f] for f in self.fields) >= 2**31 else None
        self.register_buffer("_wide_offsets", torch.tensor([offsets[f] for f in self.fields]), persistent=False)
        self._cowclip: CowClipConfig | None = None
        self._cowclip_lookups: set[str] = set()
        self._cowclip_stats: CowClipStats | None = None

    def set_local_cowclip(self, cfg: CowClipConfig | None, lookups: set[str], stats: CowClipStats | None = None) -> None:
        self._cowclip = cfg if cfg is not None and lookups else None
        self._cowclip_lookups = set(lookups)
        self._cowclip_stats = stats

    def with_wide_keys(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` plus one key ``wide_<f>`` per field: the same bags, ids shifted to the field's rows."""
        if features.keys() != self.fields:
            raise ValueError(f"SparseArch expects the KJT keys {self.fields}, got {features.keys()}")
        values, lengths = features.values(), features.lengths()
        per_key = lengths.view(len(self.fields), -1).sum(dim=1)  # on the device: no host round trip
        shift = torch.repeat_interleave(self._wide_offsets.to(values.device), per_key, output_size=values.numel())
        ids = values.to(self._wide_dtype or values.dtype)
        known = features.length_per_key_or_none()  # passed on when cached: TorchRec's input split sizes
        return KeyedJaggedTensor(keys=self.fields + self._wide_keys, values=torch.cat([ids, ids + shift]),
                                 lengths=torch.cat([lengths, lengths]), stride=features.stride(),
                                 length_per_key=None if known is None else known * 2)

    def _local_cowclip(self, pooled: torch.Tensor, prefix: str, width: int, ids: torch.Tensor) -> torch.Tensor:
        blocks = [(j * width, (j + 1) * width, ids[j], self._cowclip.clips(prefix + f))
                  for j, f in enumerate(self.fields) if prefix + f in self._cowclip_lookups]
        world = dist.get_world_size() if dist.is_initialized() else 1
        return apply_cowclip(pooled, blocks, self._cowclip, grad_scale=1.0 / world, l2_share=1.0 / world,
                             stats=self._cowclip_stats)

    def forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.wide:
            features = self.with_wide_keys(features)
        pooled = self.ebc(features)
        if pooled.keys() == self._flat_keys:  # the groups are column ranges of the values: views, no copy
            groups = list(pooled.values().split(self._group_widths, dim=1))
        else:
            groups = KeyedTensor.regroup([pooled], self._groups)
        if self._cowclip is not None:
            ids = one_hot_ids(features)  # [K, B]: the wide keys' ids are rows of the shared table
            groups[0] = self._local_cowclip(groups[0], EMB_PREFIX, self.embedding_dim, ids)
            if self.wide:
                groups[1] = self._local_cowclip(groups[1], WIDE_PREFIX, WIDE_COLUMNS, ids[self.num_fields:])
        emb = groups[0].reshape(-1, self.num_fields, self.embedding_dim)
        if not self.wide:
            return emb, None
        first_order = groups[1].reshape(-1, self.num_fields, WIDE_COLUMNS)[..., 0].sum(dim=1)
        return emb, first_order

