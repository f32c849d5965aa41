"""Scoring on the CPU of any machine: a model folder or checkpoint loaded once, raw rows or encoded
arrays in, click probabilities out, batch by batch without gradients."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from torchrec import KeyedJaggedTensor

from modules.embedding.sparse_arch import FeatureSpec, is_table_parameter
from modules.models import build_model
from pipeline.data.batches import make_batch
from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import BundleError
from pipeline.model_folder.quantize import share_fused_buffers, use_quantized_tables
from pipeline.scoring.row_encoder import RowEncoder
from pipeline.model_folder.source import model_source
from pipeline.model_folder.weights import read_weights, read_zch_state

SMALL_BATCH_COPY_MAX_BYTES = 4 << 30  # float tables larger than this get no fused copy for small batches


def score_batches(model: torch.nn.Module, spec: FeatureSpec, arrays: SplitArrays, batch_size: int = 65536,
                  rows: np.ndarray | None = None,
                  remap: Callable[[KeyedJaggedTensor], KeyedJaggedTensor] | None = None) -> np.ndarray:
    """Click probabilities of ``rows`` of ``arrays`` (default: every row), in that order (the model in eval
    mode, no gradients; a sharded model's collectives need autograd-aware tensors: no inference mode here).
    ``remap``: each batch's ids through it first (raw ids → rows)."""
    rows = np.arange(len(arrays)) if rows is None else rows
    out = np.empty(len(rows), np.float32)
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            batch = make_batch(arrays, part, spec.kjt_keys, categorical=spec.categorical)
            sparse = batch.sparse_features if remap is None else remap(batch.sparse_features)
            out[start:start + len(part)] = torch.sigmoid(model(batch.dense_features, sparse)).float().numpy()
    return out


class Scorer(RowEncoder):
    """A model folder (or, with ``table_dir`` for its tables, a checkpoint) loaded for scoring on the CPU;
    a quantized folder's tables are scored by TorchRec's quantized collections (:mod:`pipeline.model_folder.quantize`), and so
    are float tables with ``fused`` (FBGEMM's fused inference kernel, the same numbers). The fused kernel
    copies the tables into memory; with ``shared_dir`` (a folder for this model) that copy is written
    there once and mapped, so that processes scoring the model share it.

    ``small_batch_rows`` > 0 (float tables): batches of at most that many rows go to a second model over
    the same dense weights with the fused kernel — its per-call cost is about half the collection's at
    one row (52 ``embedding_bag`` calls through TorchRec's KJT against one FBGEMM call), while at
    thousands of rows the collection is faster — at the price of that copy of the tables (not made for
    tables over :data:`SMALL_BATCH_COPY_MAX_BYTES`)."""

    def __init__(self, path: str | os.PathLike, table_dir: Path | None = None, fused: bool = False,
                 shared_dir: Path | None = None, small_batch_rows: int = 0) -> None:
        source = model_source(path)
        self.folder = source.path
        super().__init__(source.store_meta, source.data, source.vocab_root, read_zch_state(source))
        self.model_cfg = source.model_cfg
        weights = read_weights(source, table_dir)
        kernel = source.quantize if source.quantize != "none" else "fp32" if fused else None
        self.model, self.quantized = self._build(weights, kernel, shared_dir)
        tables = sum(w.numel() * w.element_size() for k, w in weights.items() if is_table_parameter(k))
        self.small_batch_rows = small_batch_rows if kernel is None and tables <= SMALL_BATCH_COPY_MAX_BYTES else 0
        self.small_model = self._build(weights, "fp32", shared_dir)[0] if self.small_batch_rows else None

    def _build(self, weights: dict[str, torch.Tensor], kernel: str | None, shared_dir: Path | None
               ) -> tuple[torch.nn.Module, tuple[str, ...]]:
        """The model in eval mode over ``weights`` (its tables in FBGEMM's fused ``kernel``, or the float
        collection when None), and the names of its modules scored by the fused kernel."""
        model = build_model(self.model_cfg, self.spec, device=torch.device("meta"))
        weights = dict(weights)
        quantized: tuple[str, ...] = ()
        if kernel is not None:
            tables = [k for k in weights if is_table_parameter(k) and weights[k].dim() == 2]
            quantized = tuple(use_quantized_tables(model, {k: weights.pop(k) for k in tables}, kernel))
            if shared_dir is not None:
                share_fused_buffers(model, quantized, shared_dir)
        try:  # assign: the mapped tables become the parameters (no copy into fresh tables)
            loaded = model.load_state_dict(weights, assign=True, strict=kernel is None)
        except RuntimeError as e:
            raise BundleError(f"{self.folder}: the weights do not fit the model ({e})") from None
        left = [k for k in (*loaded.missing_keys, *loaded.unexpected_keys)
                if not k.startswith(tuple(f"{m}." for m in quantized))]
        if left:
            raise BundleError(f"{self.folder}: the weights do not fit the model (keys {left[:5]})")
        return model.eval(), quantized

    def table_bytes(self) -> int:
        """Bytes of the embedding tables as scored (float32, or quantized rows)."""
        if self.quantized:
            modules = [self.model.get_submodule(m) for m in self.quantized]
            return sum(w.numel() * w.element_size() for m in modules for w in m.state_dict().values())
        return sum(p.numel() * p.element_size() for k, p in self.model.state_dict().items() if is_table_parameter(k))

    def score(self, arrays: SplitArrays, batch_size: int = 65536) -> np.ndarray:
        model = self.small_model if len(arrays) <= self.small_batch_rows else self.model
        with torch.inference_mode():  # one process, no autograd at all
            return score_batches(model, self.spec, arrays, batch_size)

    def score_frame(self, frame: pd.DataFrame) -> np.ndarray:
        """Probabilities of the rows of a DataFrame of raw columns."""
        return self.score(self.encode_frame(frame))
