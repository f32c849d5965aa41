"""The sparse side every model shares: TorchRec embedding collections over all sparse features.

A feature reads an embedding *table* (its own, or another feature's with ``share_table_with``):

* ``emb_<t>``: table ``t`` (``embedding_dim`` columns), read by the KJT key of every feature on it,
  used by the FM / deep / cross parts and by CowClip;
* (optional) the first-order ("wide", linear) weights of table ``t``: rows ``[o_t, o_t + n_t)`` of one
  table shared by all tables, read by the key ``wide_<f>`` whose ids are the feature's ids shifted by
  ``o_t`` (:func:`wide_row_offsets`; :meth:`SparseArch.forward` adds these keys). FBGEMM kernels need
  a column count divisible by 4, so the table has 4 columns and only column 0 is used: exactly a
  scalar weight per id for element-wise optimizers (the other columns get zero gradient).

Tables read by one categorical (one-id) feature live in an ``EmbeddingBagCollection`` (``ebc``;
first-order table ``wide``): a one-id bag's pooled output is the row itself. Tables read by a sequence
(multi-hot) feature or by several features live in an ``EmbeddingCollection`` (``ec``; their
first-order table ``wide_seq`` in ``ec_wide``, since a collection's tables share one width), which
returns one row per id; :class:`SparseArch` pools each bag itself (sum or mean, per feature,
:func:`pool_bags`), so features of any pooling can share a table and the gradient of every occurrence
of an id is there to be clipped exactly (:class:`UnpooledLookups`).

Why one wide table rather than one per field: every id is looked up, gradient-sorted and updated by
the embedding backward once per table it feeds; on CPU, FBGEMM's row-wise Adagrad backward takes
≈ 19 ms for 26 four-column tables at batch 8,192 and ≈ 9 ms for the same lookups as 26 features
of one table (benchmarks in docs/throughput.md). The update of a row is the same either way: each
row belongs to one table.

With ``stack`` (``model.stack_tables``), the ``emb_<t>`` tables of the bag collection are rows
``[o_t, o_t + n_t)`` of one table ``stacked`` — the first-order table's layout at ``embedding_dim``
columns — read by the features' own keys with shifted ids (:mod:`modules.embedding.lookup_inputs`). The model
and each row's update are the same; FBGEMM's CPU backward runs once over all the ids instead of once
per table (≈ 10 % of a DeepFM step at batch 8,192, docs/throughput.md). The lookups keep their names
(``emb_<t>``); placement and sharding see one table, so it goes to one tier and, table-wise, one rank.

CowClip and the per-id L2 term work per *lookup* — ``emb_<t>`` or ``wide_<f>`` — whatever table it
reads (:attr:`SparseArch.lookup_names`, :func:`lookup_name`); they are attached from outside
(:mod:`modules.optim.cowclip_hooks`), to the sharded lookups or to :class:`PooledLookups` /
:class:`UnpooledLookups`. A sharded collection returns its outputs in sharding order, not config
order, so the outputs are selected by key (``KeyedTensor.regroup``), never by position.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)

from modules.embedding.feature_spec import FeatureSpec
from modules.embedding.lookup_inputs import check_ids, pool_bags, shifted_keys
from modules.embedding.row_init import RowInit
from modules.embedding.table_precision import DATA_TYPES

WIDE_COLUMNS = 4
EMB_PREFIX = "emb_"
WIDE_PREFIX = "wide_"
WIDE_TABLE = "wide"
WIDE_SEQ_TABLE = "wide_seq"
STACKED_TABLE = "stacked"


def wide_row_offsets(spec: FeatureSpec, features: Sequence[str] | None = None) -> dict[str, int]:
    """First row of each feature's first-order weights in its shared first-order table: tables in order
    of first use by ``features`` (default: the bag collection's), each table's rows once."""
    offsets, table_rows, row = {}, {}, 0
    for f in spec.bag_features if features is None else features:
        t = spec.table_of(f)
        if t not in table_rows:
            table_rows[t] = row
            row += spec.table_sizes[t]
        offsets[f] = table_rows[t]
    return offsets


def is_table_parameter(name: str) -> bool:
    """Whether a parameter name (as the model's ``named_parameters`` / ``state_dict`` spell it) is an
    embedding table of either collection."""
    return ".embedding_bags." in name or ".embeddings." in name


def field_of(feature: str) -> str:
    """The feature a KJT key reads: ``f`` for ``f`` and for ``wide_<f>``."""
    return feature[len(WIDE_PREFIX):] if feature.startswith(WIDE_PREFIX) else feature


def lookup_field(lookup: str) -> str:
    """The table (``emb_<t>``) or feature (``wide_<f>``) of a lookup name."""
    for prefix in (EMB_PREFIX, WIDE_PREFIX):
        if lookup.startswith(prefix):
            return lookup[len(prefix):]
    raise ValueError(f"{lookup!r} is not a lookup name (expected {EMB_PREFIX}<table> or {WIDE_PREFIX}<feature>)")


def lookup_name(table: str, feature: str) -> str:
    """The lookup a (table, KJT key) pair makes: the table's name, ``wide_<f>`` in a first-order table,
    ``emb_<f>`` in the stacked table (whose features each read their own table)."""
    if table == STACKED_TABLE:
        return EMB_PREFIX + feature
    return feature if table in (WIDE_TABLE, WIDE_SEQ_TABLE) else table


def table_configs(spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool,
                  unpooled: bool = False, stack: bool = False, seed: int = 0,
                  precision: str = "fp32") -> list[EmbeddingBagConfig] | list[EmbeddingConfig]:
    """The tables of the bag collection (``unpooled`` False) or of the sequence collection (True): ``emb_<t>``
    per table in order of first use (with ``stack``, the bag collection's as one table ``stacked``), then the
    first-order table of their features. Rows start as N(0, ``init_std``²) drawn from (``seed``, table, row)
    (:mod:`modules.embedding.row_init`: a stacked table's rows as its tables' own), the first-order rows as zeros;
    every table stored in ``precision`` (:mod:`modules.embedding.table_precision`)."""
    if embedding_dim % 4:
        raise ValueError(f"model.embedding_dim={embedding_dim}: FBGEMM kernels need a multiple of 4")
    features = spec.seq_features if unpooled else spec.bag_features
    make = partial(EmbeddingConfig, data_type=DATA_TYPES[precision]) if unpooled \
        else partial(EmbeddingBagConfig, pooling=PoolingType.SUM, data_type=DATA_TYPES[precision])
    by_table: dict[str, list[str]] = {}
    for f in features:
        by_table.setdefault(spec.table_of(f), []).append(f)
    tables = [make(name=EMB_PREFIX + t, embedding_dim=embedding_dim, num_embeddings=n, feature_names=names,
                   init_fn=RowInit.of_tables(seed, init_std, [EMB_PREFIX + t], [n]))
              for t, names in by_table.items() for n in [spec.table_sizes[t]]]
    if stack and not unpooled and tables:  # a bag feature's table is its own (FeatureSpec.unpooled_tables)
        init = RowInit.of_tables(seed, init_std, [t.name for t in tables], [t.num_embeddings for t in tables])
        tables = [make(name=STACKED_TABLE, embedding_dim=embedding_dim, feature_names=list(features),
                       init_fn=init, num_embeddings=sum(t.num_embeddings for t in tables))]
    if wide and features:
        if clash := [f for f in features if f.startswith(WIDE_PREFIX)]:
            raise ValueError(f"sparse features {clash}: names starting with {WIDE_PREFIX!r} are reserved for the "
                             "first-order lookups")
        name, rows = WIDE_SEQ_TABLE if unpooled else WIDE_TABLE, sum(spec.table_sizes[t] for t in by_table)
        tables.append(make(name=name, embedding_dim=WIDE_COLUMNS, num_embeddings=rows,
                           feature_names=[WIDE_PREFIX + f for f in features],
                           init_fn=RowInit.of_tables(seed, 0.0, [name], [rows])))
    return tables


class PooledLookups(nn.Module):
    """Identity over the pooled lookups of the bag collection: ``emb`` [B, F·D], ``wide`` [B, F·4] or None,
    and the KJT they were looked up with (ids of the ``emb`` keys first, then the ``wide_<f>`` keys).

    A named place in the model where gradient hooks attach from outside (local-scope CowClip and the
    per-id L2 term, :mod:`modules.optim.cowclip_hooks`), as TorchRec's sharded lookups are for global scope.
    """

    def forward(self, emb: torch.Tensor, wide: torch.Tensor | None,
                features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return emb, wide


class UnpooledLookups(nn.Module):
    """Identity over the sequence collection's rows before pooling: ``emb`` [N, D] (one row per id of the
    sequence-collection keys, key after key), ``wide`` [N, 4] or None (the same ids' first-order rows),
    and the KJT they were looked up with (those keys, then their ``wide_<f>`` keys). Where CowClip sees
    every occurrence of an id with its own gradient (:mod:`modules.optim.cowclip_hooks`)."""

    def forward(self, emb: torch.Tensor, wide: torch.Tensor | None,
                features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return emb, wide


class SparseArch(nn.Module):
    """Looks up all sparse features: returns embeddings ``[B, F, D]`` (features in ``spec.kjt_keys``
    order) and first-order logits ``[B]`` (or None). Takes a KeyedJaggedTensor with those keys.
    ``stack``: the bag collection's tables as one stacked table (module docstring)."""

    def __init__(self, spec: FeatureSpec, embedding_dim: int, init_std: float, wide: bool,
                 device: torch.device | None = None, stack: bool = False, precision: str = "fp32") -> None:
        super().__init__()
        self.fields = list(spec.kjt_keys)
        self.num_fields = len(self.fields)
        self.embedding_dim = embedding_dim
        self.wide, self.stack = wide, stack
        self.bag_fields, self.seq_fields = list(spec.bag_features), list(spec.seq_features)
        # one draw of the CPU generator (the same on any device): rows come from (seed, table, row), row_init
        seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        self.ebc = EmbeddingBagCollection(tables=table_configs(spec, embedding_dim, init_std, wide, stack=stack, seed=seed,
                                                                        precision=precision),
                                          device=device) if self.bag_fields else None
        # a collection's tables share one width: the first-order rows (4 columns) are a collection of their own
        seq_tables = table_configs(spec, embedding_dim, init_std, wide, unpooled=True, seed=seed,
                                   precision=precision)
        self.ec = EmbeddingCollection(tables=[t for t in seq_tables if t.name != WIDE_SEQ_TABLE], device=device) \
            if self.seq_fields else None
        self.ec_wide = EmbeddingCollection(tables=[t for t in seq_tables if t.name == WIDE_SEQ_TABLE], device=device) \
            if self.seq_fields and wide else None
        self.pooled = PooledLookups()
        self.unpooled = UnpooledLookups()
        self._wide_keys = [WIDE_PREFIX + f for f in self.bag_fields] if wide else []
        self._groups = [self.bag_fields] + ([self._wide_keys] if wide else [])
        self._flat_keys = self.bag_fields + self._wide_keys  # pooled output keys in group order
        self.lookup_names = [EMB_PREFIX + t for t in dict.fromkeys(spec.table_of(f) for f in self.fields)] \
            + ([WIDE_PREFIX + f for f in self.fields] if wide else [])
        self.tables = {f: spec.table_of(f) for f in self.fields}
        self._group_widths = [len(self.bag_fields) * embedding_dim] + ([len(self.bag_fields) * WIDE_COLUMNS] if wide else [])
        rows = sum(spec.table_sizes[t] for t in dict.fromkeys(self.tables.values()))
        self._wide_dtype = torch.int64 if rows >= 2**31 else None
        bag_offsets, seq_offsets = wide_row_offsets(spec), wide_row_offsets(spec, self.seq_fields)
        self.register_buffer("_wide_offsets", torch.tensor([bag_offsets[f] for f in self.bag_fields], device="cpu"),
                             persistent=False)
        self.register_buffer("_seq_wide_offsets", torch.tensor([seq_offsets[f] for f in self.seq_fields], device="cpu"),
                             persistent=False)
        self.register_buffer("_table_rows", torch.tensor([spec.table_sizes[self.tables[f]] for f in self.fields],
                                                         device="cpu"),
                             persistent=False)
        self.register_buffer("_seq_mean", torch.tensor([spec.pooling.get(f) == "mean" for f in self.seq_fields],
                                                       dtype=torch.bool, device="cpu"), persistent=False)

    def forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if features.keys() != self.fields:
            raise ValueError(f"SparseArch expects the KJT keys {self.fields}, got {features.keys()}")
        if features.values().device.type == "cpu":  # on CUDA, FBGEMM's parallel check, without a host sync
            check_ids(features, self._table_rows)
        bags, sequences = self._parts(features)
        if self.ec is None:
            return self._bags(bags)
        if self.ebc is None:
            return self._sequences(sequences)
        emb, first = self._bags(bags)
        seq_emb, seq_first = self._sequences(sequences)
        return torch.cat([emb, seq_emb], dim=1), None if first is None else first + seq_first

    def inputs(self, features: KeyedJaggedTensor) -> list[tuple[nn.Module, KeyedJaggedTensor]]:
        """(collection, the KJT :meth:`forward` calls it with) for each collection: what the ``ssd`` tier's
        row caches look ahead with (:mod:`modules.embedding.ssd_tier.rows_ahead`). The ids are checked
        first, as :meth:`forward` checks them: no row cache ever sees an id outside its table."""
        if features.values().device.type == "cpu":
            check_ids(features, self._table_rows)
        bags, sequences = self._parts(features)
        out = [(self.ebc, self._bag_keys(bags))] if self.ebc is not None else []
        if self.ec is not None:
            out.append((self.ec, sequences))
            if self.ec_wide is not None:
                out.append((self.ec_wide, self._seq_wide_keys(sequences)[1]))
        return out

    def _parts(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        """(the bag collection's keys, the sequence collection's); one of them is all of ``features``."""
        if self.ec is None or self.ebc is None:
            return features, features
        bags, sequences = features.split([len(self.bag_fields), len(self.seq_fields)])
        return bags, sequences

    def _bag_keys(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if self.wide or self.stack:
            return shifted_keys(features, self._wide_offsets, self._wide_dtype, self.stack, self._wide_keys)
        return features

    def _seq_wide_keys(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        """The sequence keys followed by their first-order keys, and the first-order keys alone (``ec_wide``'s)."""
        shifted = shifted_keys(features, self._seq_wide_offsets, self._wide_dtype, False,
                               [WIDE_PREFIX + f for f in self.seq_fields])
        return shifted, shifted.split([len(self.seq_fields)] * 2)[1]

    def _bags(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        features = self._bag_keys(features)
        pooled = self.ebc(features)
        if pooled.keys() == self._flat_keys:  # the groups are column ranges of the values: views, no copy
            groups = list(pooled.values().split(self._group_widths, dim=1))
        else:
            groups = KeyedTensor.regroup([pooled], self._groups)
        emb, wide = self.pooled(groups[0], groups[1] if self.wide else None, features)
        emb = emb.reshape(-1, len(self.bag_fields), self.embedding_dim)
        if wide is None:
            return emb, None
        return emb, wide.reshape(-1, len(self.bag_fields), WIDE_COLUMNS)[..., 0].sum(dim=1)

    def _sequences(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, k = features.stride(), len(self.seq_fields)
        lengths = features.lengths()
        rows = self.ec(features)
        emb = torch.cat([rows[f].values() for f in self.seq_fields])
        wide = None
        if self.wide:
            features, wide_keys = self._seq_wide_keys(features)
            first_rows = self.ec_wide(wide_keys)
            wide = torch.cat([first_rows[WIDE_PREFIX + f].values() for f in self.seq_fields])
        emb, wide = self.unpooled(emb, wide, features)
        pooled = pool_bags(emb, lengths, self._seq_mean).view(k, b, self.embedding_dim).transpose(0, 1)
        if wide is None:
            return pooled, None
        first = pool_bags(wide[:, :1], lengths, self._seq_mean).view(k, b).sum(dim=0)
        return pooled, first
