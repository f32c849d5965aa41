"""Preprocessing with ``categorical: raw`` in one streaming pass (:mod:`pipeline.data.preprocess`).

Raw ids need nothing learnt from the whole log before a row is encoded — no vocabulary, no counts — so
each parsed block is encoded and appended to the store at once: no spill to scratch files and no second
read, unlike the vocabulary's two passes. Per block:

* every categorical and sequence value → its 64-bit key (:func:`pipeline.data.hashing.factorized_string_keys`,
  the distinct keys of the block hashed once) → its 63-bit raw id of (table, key)
  (:func:`pipeline.data.encoding.raw_ids`, missing → 0);
* numeric features transformed as declared — except ``minmax``, whose training range is known only at
  the end: those columns are written as parsed (NaN = missing) and rescaled in place in the written
  ``dense.npy`` arrays (:meth:`pipeline.data.store.StoreWriter.rewrite_dense`: a pass over that one
  array, not over the raw files).

With ``split.method: sequential`` the files' lines are counted first (a newline count, as for the two passes), since
a row's split depends on its position from the end.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pipeline.data.dataset import DataConfig
from pipeline.data.encoding import encode_ids, transform_dense
from pipeline.data.hashing import factorized_string_keys
from pipeline.data.pass1 import SPLIT_CODES, ParsedBlocks, Sources, Tables, finite_range, no_rows_error, widen_range
from pipeline.data.prefetch import prefetch
from pipeline.data.store import SPLITS, StoreWriter


@dataclass
class RawPass:
    """What the pass leaves besides the store's arrays: rows and positives per split, the numeric
    features' training ranges (``minmax``), rows skipped as bad and sequences cut."""

    split_rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    positives: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    lo: np.ndarray = field(default_factory=lambda: np.zeros(0))
    hi: np.ndarray = field(default_factory=lambda: np.zeros(0))
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)


def run_raw_pass(sources: Sources, data: DataConfig, total_rows: int, writer: StoreWriter,
                 pool: ThreadPoolExecutor) -> RawPass:
    """Parse, encode and write every row of ``sources`` in one pass; ``writer`` is left open (the caller commits)."""
    tables = Tables.of_data(data)
    names = [tables.names[t] for t in tables.of]
    n_cat = len(data.categorical)
    transforms = [data.decl(f).transform for f in data.numeric]
    minmax = [j for j, t in enumerate(transforms) if t == "minmax"]
    now = [j for j, t in enumerate(transforms) if t != "minmax"]
    out = RawPass(lo=np.full(len(transforms), np.inf), hi=np.full(len(transforms), -np.inf))
    blocks = ParsedBlocks(sources, data, total_rows, "preprocess (raw ids, one pass)")

    def ids(block_sparse: list, j: int) -> np.ndarray:
        codes, distinct = factorized_string_keys(block_sparse[j])
        return encode_ids(distinct, codes, None, 0, names[j])

    for block, split in prefetch(blocks):
        if minmax:
            widen_range(out.lo, out.hi, block.numeric[split == SPLIT_CODES["train"]], minmax)
        dense = block.numeric
        if now:
            dense[:, now] = transform_dense(dense[:, now], [transforms[j] for j in now], out.lo[now], out.hi[now])
        encoded = list(pool.map(lambda j: ids(block.sparse, j), range(len(names))))
        bags = list(zip(block.lengths[n_cat:], encoded[n_cat:]))
        for name, positives in writer.append_block(split, block.label, dense, encoded[:n_cat], bags, block.time).items():
            out.positives[name] += positives
    out.split_rows = dict(writer.rows)
    if sum(out.split_rows.values()) == 0:
        raise no_rows_error(sources, blocks.skipped())
    out.lo, out.hi = finite_range(out.lo, out.hi)
    writer.rewrite_dense(minmax, lambda x: transform_dense(x, ["minmax"] * len(minmax), out.lo[minmax], out.hi[minmax]))
    out.skipped, out.truncated = blocks.skipped(), blocks.truncated
    return out
