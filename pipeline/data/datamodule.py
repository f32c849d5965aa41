"""LightningDataModule over a columnar store: prepares it once per node, serves per-rank batches."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from modules.optim.cowclip import RowBuckets, frequency_bucket
from modules.embedding.sparse_arch import EMB_PREFIX, STACKED_TABLE, WIDE_SEQ_TABLE, WIDE_TABLE, FeatureSpec, wide_row_offsets
from pipeline.data.batches import BatchLoader
from pipeline.data.dataset import DataConfig
from pipeline.data.sources import prepare_store, store_dir
from modules.embedding.zch.config import ZchConfig
from pipeline.data.store import FIRST_VOCAB_ID, ColumnarStore, has_raw_ids, with_table_sizes
from pipeline.data.vocab_files import read_vocabulary
from pipeline.runtime.errors import ConfigError


class CTRDataModule(L.LightningDataModule):
    def __init__(self, data: DataConfig, cache_dir: str | Path, batch_size: int, eval_batch_size: int,
                 seed: int, zch: ZchConfig | None = None, shuffle: bool = True) -> None:
        super().__init__()
        self.zch = zch or ZchConfig()  # model.zch: sizes the tables of a raw store
        self.data_cfg = data
        self.cache_dir = Path(cache_dir)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.shuffle = shuffle  # trainer.shuffle: off, training batches in the files' order
        self.prepare_data_per_node = True
        self.store: ColumnarStore | None = None
        self.resume_position: tuple[int, int] | None = None  # (epoch, next batch) from a checkpoint

    def prepare_data(self) -> None:  # local rank 0 of each node; others wait at a barrier
        prepare_store(self.data_cfg, self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.store is None:
            self.store = ColumnarStore(store_dir(self.data_cfg, self.cache_dir))

    @property
    def feature_spec(self) -> FeatureSpec:
        assert self.store is not None, "setup() first"
        return FeatureSpec.from_store_meta(self.meta)

    @property
    def meta(self) -> dict:
        """The store's meta, with the table sizes of a raw store (``model.zch``) filled in."""
        assert self.store is not None, "setup() first"
        return with_table_sizes(self.store.meta, self.zch)

    @property
    def coverage(self) -> dict[str, dict[float, int]]:
        """Per table: how many of the hottest ids carry each share of the training occurrences; all of them
        (share 1.0) the table's distinct training values — given only where the splits were drawn at random
        from the same rows: a sequential or given split's evaluation rows may meet values training never did,
        and placement sizes the least row caches by this count (:func:`modules.sharding.placement.cache_floor`)."""
        assert self.store is not None, "setup() first"
        drawn = self.store.meta.get("preprocess", {}).get("split", {}).get("method") == "random"
        return {f: {**{float(q): int(n) for q, n in s.get("coverage_rows", {}).items()},
                    **({1.0: int(s["distinct_train"])} if drawn and "distinct_train" in s and s.get("coverage_rows")
                       else {})}
                for f, s in self.store.meta["stats"].items()}

    def row_buckets(self) -> RowBuckets:
        """Each embedding row's id-frequency bucket from the vocabulary counts (:func:`modules.optim.cowclip.frequency_bucket`;
        the OOV and missing rows, and every row of a hashed table, are "unknown")."""
        assert self.store is not None, "setup() first"
        spec = self.feature_spec
        counts: dict[str, torch.Tensor] = {}
        for table, rows in spec.table_sizes.items():
            c = torch.full((rows,), -1, dtype=torch.int64, device="cpu")
            vocab = read_vocabulary(self.store.root, table, columns=("count",))
            if vocab is not None:  # ids below FIRST_VOCAB_ID: OOV and missing
                c[FIRST_VOCAB_ID:FIRST_VOCAB_ID + len(vocab.counts)] = torch.from_numpy(vocab.counts)
            counts[table] = c
        tables = {EMB_PREFIX + t: frequency_bucket(c) for t, c in counts.items()}
        for name, features in ((WIDE_TABLE, spec.bag_features), (WIDE_SEQ_TABLE, spec.seq_features)):
            offsets = wide_row_offsets(spec, features)
            if offsets:
                wide = torch.zeros(max(offsets[f] + spec.table_sizes[spec.table_of(f)] for f in features),
                                   dtype=torch.int8, device="cpu")
                for f in features:
                    part = tables[EMB_PREFIX + spec.table_of(f)]
                    wide[offsets[f]:offsets[f] + len(part)] = part
                tables[name] = wide
        if WIDE_TABLE in tables:
            tables[STACKED_TABLE] = tables[WIDE_TABLE]  # the same tables' rows in the same layout
        return RowBuckets(tables)

    def _loader(self, split: str, train: bool) -> BatchLoader:
        """On a GPU: page-locked batches, one-hot training batches built ahead by a thread (``background``), and ids
        checked against their tables on the host (on the CPU the model checks them: modules/embedding/lookup_inputs.py;
        a raw store's ids are mapped by model.zch, a CPU path)."""
        assert self.store is not None, "setup() first"
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        gpu = torch.cuda.is_available() and trainer is not None and trainer.strategy.root_device.type == "cuda"
        spec = self.feature_spec
        rows = [spec.table_sizes[spec.table_of(f)] for f in spec.kjt_keys] if gpu and not has_raw_ids(self.store.meta) else None
        return BatchLoader(self.store.split(split), spec.kjt_keys, self.batch_size if train else self.eval_batch_size,
                           rank, world, train, self.seed, pin_memory=gpu, categorical=self.store.categorical_names,
                           shuffle=self.shuffle, background=gpu, table_rows=rows)

    def train_dataloader(self) -> BatchLoader:
        loader = self._loader("train", train=True)
        rows, batch = len(loader.arrays), loader.global_batch_size
        if loader.num_batches == 0:  # training takes whole batches only: not one step would run
            raise ConfigError(f"trainer.batch_size={batch}: the training split holds {rows:,} rows, fewer than one "
                              f"batch, so no training step would run; set trainer.batch_size to at most {rows:,} "
                              f"(or give more rows)")
        if rows % batch and (self.trainer is None or self.trainer.global_rank == 0):
            print(f"Each epoch trains {loader.num_batches:,} batches of {batch:,} rows: {rows % batch:,} of its {rows:,} "
                  f"training rows (a partial batch, other rows each epoch when shuffled) are left out", flush=True)
        if self.resume_position is not None:
            loader.resume_at(*self.resume_position)
        return loader

    def val_dataloader(self) -> BatchLoader:
        return self._loader("valid", train=False)

    def test_dataloader(self) -> BatchLoader:
        return self._loader("test", train=False)
