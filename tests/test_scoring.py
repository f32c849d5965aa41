"""The pieces of the scoring path against references computed another way: the joint vocabulary index
against one pandas index per table, row-wise quantization against its formula in NumPy, the one-pass
frame encoder against the generic reader path."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.vocab_growth import FREE, VocabIndex
from pipeline.scoring.joint_index import JointVocabIndex
from pipeline.model_folder.quantize import quantize_rows, row_bytes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), unique=True, max_size=30), min_size=1, max_size=4),
       st.integers(0, 2**32))
def test_joint_index_finds_what_each_tables_own_index_finds(tables, seed):
    """Small key ranges: the same key in several tables, a free position (key 0), absent keys."""
    vocabularies = {f"t{i}": np.array(keys, np.uint64) for i, keys in enumerate(tables)}
    assert all((keys == FREE).sum() <= 1 for keys in vocabularies.values())
    joint = JointVocabIndex(vocabularies)
    queries = np.random.default_rng(seed).integers(0, 45, 50).astype(np.uint64)
    for name, keys in vocabularies.items():
        np.testing.assert_array_equal(joint.table(name).positions_of(queries), VocabIndex(keys).positions_of(queries))


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_quantized_rows_follow_the_rowwise_formula(dtype, bits):
    """codes = round((w − min) / scale), scale = (max − min) / (2^b − 1), scale and bias in fp16 after the
    codes; dequantized values within scale/2 (plus fp16 rounding of scale and bias) of the row."""
    w = torch.randn(64, 16) * torch.logspace(-3, 1, 64)[:, None]
    q = quantize_rows(w, dtype).numpy()
    assert q.shape == (64, row_bytes(16, dtype))
    scale = q[:, -4:-2].copy().view(np.float16).astype(np.float64)[:, 0]
    bias = q[:, -2:].copy().view(np.float16).astype(np.float64)[:, 0]
    packed = q[:, :-4]
    codes = packed if bits == 8 else np.stack([packed & 0xF, packed >> 4], axis=2).reshape(64, 16)
    x = w.double().numpy()
    lo, hi = x.min(1), x.max(1)
    np.testing.assert_allclose(bias, lo, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(scale, (hi - lo) / (2**bits - 1), rtol=1e-3, atol=1e-7)
    expected = np.clip(np.round((x - bias[:, None]) / scale[:, None]), 0, 2**bits - 1)
    assert np.abs(codes.astype(np.int64) - expected).max() <= 1  # ties and fp16 scale
    restored = codes * scale[:, None] + bias[:, None]
    assert (np.abs(restored - x) <= scale[:, None] * 0.5 + 2e-3 * np.abs(x).max(1, keepdims=True)).all()


def test_fp16_rows_are_the_half_precision_values():
    w = torch.randn(8, 12)
    q = quantize_rows(w, "fp16")
    assert q.shape == (8, row_bytes(12, "fp16"))
    assert torch.equal(q.view(torch.float16), w.half())


def test_one_pass_frame_encoding_equals_the_reader_path(tmp_path):
    """A model folder of the synthetic Criteo layout; raw rows with missing values, numbers as strings,
    integers in categorical columns: ``encode_frame`` gives the ids and numbers of ``encode(frame_block)``."""
    from modules.embedding.sparse_arch import FeatureSpec
    from modules.models import ModelConfig, build_model
    from pipeline.data.dataset import builtin_layout
    from pipeline.data.store import FIRST_VOCAB_ID
    from pipeline.data.vocab_files import write_vocabulary
    from pipeline.data.vocab_growth import fresh
    from pipeline.model_folder.layout import write_bundle
    from pipeline.scoring.scorer import Scorer

    data = builtin_layout("criteo")
    rng = np.random.default_rng(0)
    values = {c: [f"{v:08x}" for v in rng.integers(0, 50, 30)] for c in data.categorical}
    vocab_dir = tmp_path / "vocab"
    vocab_dir.mkdir()
    import pyarrow as pa

    from pipeline.data.hashing import string_keys

    sizes = {}
    for c in data.categorical:
        keys = np.unique(string_keys(pa.array(values[c][:20])))
        write_vocabulary(vocab_dir, c, fresh(keys, np.ones(len(keys), np.int64), 0))
        sizes[c] = len(keys) + FIRST_VOCAB_ID
    spec = FeatureSpec.of_data(data, sizes)
    model_cfg = ModelConfig(name="deepfm", embedding_dim=8, mlp=[16], stack_tables=False)
    model = build_model(model_cfg, spec, device=torch.device("cpu"))
    meta = {"dataset": data.name, "dense": list(data.numeric), "categorical": list(data.categorical), "sequence": [],
            "features": [{"name": f, "type": "categorical", "table": f} for f in data.categorical],
            "transforms": {f: "log1p" for f in data.numeric}, "table_sizes": sizes,
            "preprocess": {"hash_buckets": 1000, "categorical": "vocab"}}
    folder = write_bundle(tmp_path / "model", model.state_dict(), model_cfg, data, meta, vocab_dir)
    scorer = Scorer(folder)
    frame = pd.DataFrame({**{c: rng.integers(0, 100, 30).astype(float) for c in data.numeric},
                          **{c: values[c] for c in data.categorical}})
    frame.loc[3, data.numeric[0]] = np.nan
    frame[data.numeric[1]] = frame[data.numeric[1]].map(lambda v: str(int(v)))  # numbers as text
    frame.loc[5, data.numeric[1]] = ""                                            # missing as ""
    frame.loc[2, data.categorical[0]] = None
    frame[data.categorical[2]] = [int(v, 16) for v in values[data.categorical[2]]]  # integers: read as text
    fast = scorer.encode_frame(frame)
    generic = scorer.encode(scorer.frame_block(frame))
    np.testing.assert_array_equal(fast.sparse, generic.sparse)
    np.testing.assert_array_equal(fast.dense, generic.dense)
    assert (fast.sparse[:, 0] == 1).sum() == 1 and (fast.sparse >= FIRST_VOCAB_ID).any()  # missing id, known ids
    fused = Scorer(folder, fused=True)
    np.testing.assert_array_equal(fused.score_frame(frame), scorer.score_frame(frame))
