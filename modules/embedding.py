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
reads (:attr:`SparseArch.lookup_names`, :func:`lookup_name`); they are attached from outside
(:mod:`modules.cowclip_hooks`), to the sharded lookups or to :class:`PooledLookups`. A sharded
collection returns its outputs in sharding order, not config order, so the outputs are selected by
key (``KeyedTensor.regroup``), never by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType

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


def lookup_field(lookup: str) -> str:
    """The categorical field of a lookup name: ``f`` for ``emb_<f>`` and for ``wide_<f>``."""
    for prefix in (EMB_PREFIX, WIDE_PREFIX):
        if lookup.startswith(prefix):
            return lookup[len(prefix):]
    raise ValueError(f"{lookup!r} is not a lookup name (expected {EMB_PREFIX}<field> or {WIDE_PREFIX}<field>)")


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


class PooledLookups(nn.Module):
    """Identity over the pooled lookups of one batch: ``emb`` [B, F·D], ``wide`` [B, F·4] or None, and the
    KJT they were looked up with (ids of the ``emb`` keys first, then the ``wide_<f>`` keys).

    A named place in the model where gradient hooks attach from outside (local-scope CowClip and the
    per-id L2 term, :mod:`modules.cowclip_hooks`), as TorchRec's sharded lookups are for global scope.
    """

    def forward(self, emb: torch.Tensor, wide: torch.Tensor | None,
                features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return emb, wide


class SparseArch(nn.Module):
    """Looks up all fields: returns embeddings ``[B, F, D]`` and first-order logits ``[B]`` (or None).

    Takes a KeyedJaggedTensor keyed by the categorical fields.
    """

    def __init__(self, spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.num_fields = len(spec.categorical)
        self.embedding_dim = embedding_dim
        self.wide = wide
        self.fields = list(spec.categorical)
        self.ebc = EmbeddingBagCollection(tables=table_configs(spec, embedding_dim, init_std, wide), device=device)
        self.pooled = PooledLookups()
        self._wide_keys = [WIDE_PREFIX + f for f in self.fields] if wide else []
        self._groups = [self.fields] + ([self._wide_keys] if wide else [])
        self._flat_keys = self.fields + self._wide_keys  # pooled output keys in group order
        self.lookup_names = [EMB_PREFIX + f for f in self.fields] + self._wide_keys
        self._group_widths = [self.num_fields * embedding_dim] + ([self.num_fields * WIDE_COLUMNS] if wide else [])
        offsets = wide_row_offsets(spec)
        self._wide_dtype = torch.int64 if sum(spec.table_sizes[f] for f in self.fields) >= 2**31 else None
        self.register_buffer("_wide_offsets", torch.tensor([offsets[f] for f in self.fields]), persistent=False)

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

    def forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.wide:
            features = self.with_wide_keys(features)
        pooled = self.ebc(features)
        if pooled.keys() == self._flat_keys:  # the groups are column ranges of the values: views, no copy
            groups = list(pooled.values().split(self._group_widths, dim=1))
        else:
            groups = KeyedTensor.regroup([pooled], self._groups)
        emb, wide = self.pooled(groups[0], groups[1] if self.wide else None, features)
        emb = emb.reshape(-1, self.num_fields, self.embedding_dim)
        if wide is None:
            return emb, None
        return emb, wide.reshape(-1, self.num_fields, WIDE_COLUMNS)[..., 0].sum(dim=1)
