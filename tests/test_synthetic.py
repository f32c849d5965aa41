"""Synthetic Criteo-format generator: determinism, layout, sampling law, oracle AUC."""

from __future__ import annotations

import re

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from pipeline.data.synthetic import CHUNK_ROWS, SyntheticConfig, SyntheticCriteo, _bounded_zipf, generate

HEX8 = re.compile(r"^[0-9a-f]{8}$")


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path):
    cfg = SyntheticConfig(rows=CHUNK_ROWS + 1000, seed=7)  # two chunks
    generate(cfg, tmp_path / "a.tsv", progress=False)
    generate(cfg, tmp_path / "b.tsv", progress=False)
    generate(SyntheticConfig(rows=CHUNK_ROWS + 1000, seed=8), tmp_path / "c.tsv", progress=False)
    a, b, c = ((tmp_path / n).read_bytes() for n in ("a.tsv", "b.tsv", "c.tsv"))
    assert a == b
    assert a != c
    assert not list(tmp_path.glob("*.tmp-*"))


def test_criteo_layout_and_missing_rates(tmp_path):
    cfg = SyntheticConfig(rows=20_000, seed=3)
    summary = generate(cfg, tmp_path / "d.tsv", progress=False)
    lines = (tmp_path / "d.tsv").read_text().splitlines()
    assert len(lines) == cfg.rows == summary["rows"]
    missing = np.zeros(39)
    labels = []
    for line in lines:
        cols = line.split("\t")
        assert len(cols) == 40
        labels.append(int(cols[0]))
        for j, v in enumerate(cols[1:14]):
            if v == "":
                missing[j] += 1
            else:
                int(v)  # integer counts
        for j, v in enumerate(cols[14:]):
            if v == "":
                missing[13 + j] += 1
            else:
                assert HEX8.match(v), v
    assert set(labels) == {0, 1}
    assert abs(np.mean(labels) - summary["positive_rate"]) < 1e-12
    expected = np.array(cfg.dense_missing + cfg.cat_missing)
    np.testing.assert_allclose(missing / cfg.rows, expected, atol=0.015)


def test_bounded_zipf_matches_power_law_pmf():
    n, a = 40, 1.3
    rng = np.random.default_rng(0)
    r = _bounded_zipf(rng.random(400_000), n, a)
    assert r.min() >= 1 and r.max() <= n
    g = lambda x: x ** (1 - a) / (1 - a)  # antiderivative of x^-a
    edges = np.arange(1, n + 2, dtype=np.float64)
    pmf = np.diff(g(edges)) / (g(n + 1.0) - g(1.0))
    freq = np.bincount(r, minlength=n + 1)[1:] / len(r)
    np.testing.assert_allclose(freq, pmf, atol=3e-3)


def test_oracle_auc_matches_independent_computation(tmp_path):
    cfg = SyntheticConfig(rows=30_000, seed=11)  # one chunk: the file is chunk 0
    summary = generate(cfg, tmp_path / "e.tsv", progress=False)
    table, prob = SyntheticCriteo(cfg).chunk(0, cfg.rows)
    y = table.column("label").to_numpy()
    assert abs(roc_auc_score(y, prob) - summary["oracle_auc"]) < 1e-5
    assert 0.75 < summary["oracle_auc"] < 0.97


def test_effect_rank_decay_moves_the_signal_to_frequent_ids_and_leaves_the_ids_alone():
    """γ > 0 shrinks rare ids' effects: the same ids and dense values written, the logits closer to the bias
    (the effects of every id but the most frequent one of a field shrink), and γ < 0 refused."""
    base, decayed = SyntheticConfig(rows=30_000, seed=11), SyntheticConfig(rows=30_000, seed=11, effect_rank_decay=0.5)
    (t0, p0), (t1, p1) = SyntheticCriteo(base).chunk(0, base.rows), SyntheticCriteo(decayed).chunk(0, decayed.rows)
    for name in ("C1", "C10", "C26", "I1"):
        assert t0.column(name).equals(t1.column(name))
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    assert np.abs(logit(p1) - base.bias).mean() < 0.8 * np.abs(logit(p0) - base.bias).mean()
    with pytest.raises(ValueError, match="effect_rank_decay"):
        SyntheticConfig(effect_rank_decay=-1.0)
