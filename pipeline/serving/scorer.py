"""Scoring on the CPU of any machine: a model folder or checkpoint loaded once, raw rows or encoded
arrays in, click probabilities out, batch by batch without gradients."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from modules.embedding import FeatureSpec
from modules.models import build_model
from pipeline.data.batches import make_batch
from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import BundleError
from pipeline.serving.row_encoder import RowEncoder
from pipeline.serving.source import model_source
from pipeline.serving.weights import read_weights


def score_batches(model: torch.nn.Module, spec: FeatureSpec, arrays: SplitArrays, batch_size: int = 65536,
                  rows: np.ndarray | None = None) -> np.ndarray:
    """Click probabilities of ``rows`` of ``arrays`` (default: every row), in that order (the model in eval
    mode, no gradients)."""
    rows = np.arange(len(arrays)) if rows is None else rows
    out = np.empty(len(rows), np.float32)
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            batch = make_batch(arrays, part, spec.kjt_keys, categorical=spec.categorical)
            out[start:start + len(part)] = torch.sigmoid(model(batch.dense_features, batch.sparse_features)).float().numpy()
    return out


class Scorer(RowEncoder):
    """A model folder (or, with ``table_dir`` for its tables, a checkpoint) loaded for scoring on the CPU."""

    def __init__(self, path: str | os.PathLike, table_dir: Path | None = None) -> None:
        source = model_source(path)
        self.folder = source.path
        super().__init__(source.store_meta, source.data, source.vocab_root)
        self.model_cfg = source.model_cfg
        self.model = build_model(self.model_cfg, self.spec, device=torch.device("meta"))
        try:  # assign: the mapped tables become the parameters (no copy into fresh tables)
            self.model.load_state_dict(read_weights(source, table_dir), assign=True)
        except RuntimeError as e:
            raise BundleError(f"{self.folder}: the weights do not fit the model ({e})") from None
        self.model.eval()

    def score(self, arrays: SplitArrays, batch_size: int = 65536) -> np.ndarray:
        return score_batches(self.model, self.spec, arrays, batch_size)

    def score_frame(self, frame: pd.DataFrame) -> np.ndarray:
        """Probabilities of the rows of a DataFrame of raw columns."""
        return self.score(self.encode(self.frame_block(frame)))
