"""Streaming preprocessing of raw CTR files into a :mod:`pipeline.data.store`: two passes with a vocabulary
or hashing, one with raw ids (``categorical: raw``, :mod:`pipeline.data.raw_pass`: nothing to count first).

Pass 1 parses the files once, in blocks (the reader of the dataset's format, then
:func:`pipeline.data.features.extract`): it assigns every row to a split, turns every categorical and
sequence value into a 64-bit key (:func:`pipeline.data.hashing.bytes_keys` of its UTF-8 bytes;
0 = missing) and factorizes each feature's keys within the block (hash-based: the block's distinct
keys plus a 32-bit code per value — one per row, or one per value of a sequence with the bag lengths; :func:`pipeline.data.hashing.factorized_string_keys`
factorizes fixed-width values of up to 8 bytes by their raw bytes and hashes only the distinct
ones). It spills split code, label, raw dense values, codes and distinct keys to scratch files
(ordinary writes) and gathers training statistics: key counts (or hashed-bucket counts) and, for
min-max scaling, each dense column's range. Pass 2 reads the scratch files back in chunks (no
re-parsing), looks up only each block's distinct keys in the vocabulary, gathers the ids by code,
and writes the store:

* the split of each row (:mod:`pipeline.data.pass1`);
* the vocabulary of each table (:mod:`pipeline.data.vocabulary`);
* the ids and numeric features (:mod:`pipeline.data.encoding`).

Memory is bounded by the vocabularies and one block, not by the file size. Keys identify values
(a 64-bit collision among 10^7 distinct values of a field has probability ~3·10^-6); the
vocabulary file lists each kept key with its count, so new data is encoded by hashing its values.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from pipeline.data.dataset import DataConfig
from pipeline.data.encoding import encode_ids, transform_dense
from pipeline.data.features import sparse_features
from pipeline.data.pass1 import Pass1, Spill, Tables, count_rows, run_pass1, sources_from
from pipeline.data.prefetch import prefetch
from pipeline.data.raw_pass import RawPass, run_raw_pass
from pipeline.data.store import SPLITS, ColumnarStore, StoreWriter
from pipeline.data.vocab_files import write_vocabulary
from pipeline.data.vocab_growth import VocabIndex
from pipeline.data.vocabulary import Vocabulary, build_vocabulary
from pipeline.runtime.errors import DiskFullError, disk_full, ensure_space


def run_pass2(first: Pass1, vocab: Vocabulary, data: DataConfig, writer: StoreWriter,
              pool: ThreadPoolExecutor) -> dict[str, int]:
    """Encode the spilled rows and append them to the store; returns the positives per split."""
    cfg = data.preprocess
    for name, table in vocab.tables.items():
        write_vocabulary(writer.vocab_dir, name, table)
    tables = Tables.of_data(data)
    # a pandas Index keeps its hash table between lookups (pc.index_in would rebuild it per chunk)
    index = {name: VocabIndex(vocab.tables[name].keys) if name in vocab.tables else None for name in tables.names}
    n_cat = len(data.categorical)
    transforms = [data.decl(f).transform for f in data.numeric]
    positives = dict.fromkeys(SPLITS, 0)
    for chunk in prefetch(first.spill.read()):
        def encode(j: int) -> np.ndarray:
            table = tables.names[tables.of[j]]
            return encode_ids(chunk["distinct"][j], chunk["codes"][j], index[table], cfg.hash_buckets)

        ids = list(pool.map(encode, range(len(tables.of))))
        dense = transform_dense(chunk["dense"], transforms, first.lo, first.hi)
        bags = list(zip(chunk["lengths"], ids[n_cat:]))
        for name, n in writer.append_block(chunk["split"], chunk["label"], dense, ids[:n_cat], bags,
                                           chunk["time"]).items():
            positives[name] += n
    return positives


def preprocess(files: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]], data: DataConfig,
               out_dir: str | os.PathLike, provenance: dict | None = None) -> ColumnarStore:
    """Build the store of dataset ``data`` from ``files`` at ``out_dir`` (atomically; see :class:`StoreWriter`)."""
    cfg = data.preprocess
    if not data.declared():
        raise ValueError(f"data.features is empty: declare the features of data={data.name} (docs/datasets.md)")
    sources = sources_from(files)
    if (cfg.split.method == "given") != all(split is not None for _, split in sources):
        raise ValueError("preprocess.split.method='given' needs data.path as a mapping split → files (and only then)")
    t0 = time.perf_counter()
    total_rows = sum(count_rows(p, data) for p, _ in sources) if cfg.split.method == "sequential" else -1
    writer: StoreWriter | None = None
    first: Pass1 | None = None
    spill: Spill | None = None
    scratch = Path(out_dir).with_name(Path(out_dir).name + f".scratch-{os.getpid()}")
    sparse = sparse_features(data)
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(sparse), os.cpu_count() or 1)))
    try:
        id_dtype = np.dtype(np.int64 if cfg.categorical == "raw" else np.int32)  # raw ids are 63-bit
        timed = data.time is not None
        row_bytes = 1 + 4 * len(data.numeric) + id_dtype.itemsize * len(data.categorical) + 8 * timed  # label, dense, ids, time
        if cfg.categorical == "raw":  # nothing to count first: one pass, no spill
            ensure_space(out_dir, sum(os.path.getsize(p) for p, _ in sources) // 2)  # ≈ the parsed rows
            writer = StoreWriter(out_dir, len(data.numeric), len(data.categorical), data.sequence, id_dtype, timed)
            done: Pass1 | RawPass = run_raw_pass(sources, data, total_rows, writer, pool)
            vocab = build_vocabulary(None, data)
            positives = done.positives
        else:
            ensure_space(scratch, sum(os.path.getsize(p) for p, _ in sources) // 2)  # spill ≈ the parsed rows
            scratch.mkdir(parents=True, exist_ok=True)
            spill = Spill(scratch)
            done = first = run_pass1(sources, data, total_rows, spill, pool)
            vocab = build_vocabulary(first, data)
            seq_bytes = (8 + id_dtype.itemsize) * sum(sum(v) for v in first.split_values.values())  # values + offsets
            ensure_space(out_dir, first.spill.rows * row_bytes + seq_bytes)
            writer = StoreWriter(out_dir, len(data.numeric), len(data.categorical), data.sequence, id_dtype, timed,
                                 (first.split_rows, {s: dict(zip(data.sequence, v)) for s, v in first.split_values.items()}))
            positives = run_pass2(first, vocab, data, writer, pool)
        rows = done.split_rows
        tables = Tables.of_data(data)
        meta = {
            "dataset": data.name,
            "dense": list(data.numeric),
            "categorical": list(data.categorical),
            "sequence": list(data.sequence),
            "features": [{"name": f.name, "type": f.type, "table": tables.names[t],
                          **({"pooling": f.pooling} if f.type == "sequence" else {})}
                         for f, t in zip(sparse, tables.of)],
            "transforms": {f: data.decl(f).transform for f in data.numeric},
            "table_sizes": vocab.table_sizes,
            "vocabulary_day": vocab.day,
            "id_dtype": id_dtype.name,
            "time": data.time,  # the column of each row's time (time.npy), or None
            "splits": rows,
            "positive_rate": {k: positives[k] / rows[k] if rows[k] else None for k in SPLITS},
            **({"dense_range": {c: [float(done.lo[j]), float(done.hi[j])] for j, c in enumerate(data.numeric)
                                if data.decl(c).transform == "minmax"}}
               if any(data.decl(c).transform == "minmax" for c in data.numeric) else {}),
            "skipped_rows": done.skipped,
            "truncated_rows": done.truncated,
            "stats": vocab.stats,
            "preprocess": asdict(cfg),
            "provenance": provenance or {},
            "seconds": time.perf_counter() - t0,
        }
        return writer.commit(meta)
    except BaseException as e:
        if writer is not None:
            writer.abort()
        if isinstance(e, OSError) and not isinstance(e, DiskFullError):
            needed = first.spill.rows * row_bytes if first is not None else sum(os.path.getsize(p) for p, _ in sources)
            full = disk_full(e, writer.tmp_dir if writer is not None else scratch, needed)
            if full is not None:
                raise full from e
        raise
    finally:
        pool.shutdown()
        if spill is not None:
            spill.close()
        shutil.rmtree(scratch, ignore_errors=True)
