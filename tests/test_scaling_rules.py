"""Scaling-rule arithmetic against the CowClip reference table (LargeBatchCTR README, Criteo DeepFM)."""

from __future__ import annotations

import math

import pytest

from modules.optim.scaling_rules import scale_hyperparameters, warmup_factor

# batch → (dense lr, L2) from the reference table; embedding lr fixed at 1e-4
REFERENCE = {1024: (8e-4, 1e-5), 8192: (22.62e-4, 8e-5), 32768: (45.25e-4, 32e-5), 131072: (90.50e-4, 128e-5)}


@pytest.mark.parametrize("batch", sorted(REFERENCE))
def test_cowclip_rule_reproduces_reference_table(batch):
    hp = scale_hyperparameters("cowclip", batch, 1024, dense_lr=8e-4, embedding_lr=1e-4, l2=1e-5)
    dense_lr, l2 = REFERENCE[batch]
    assert hp.dense_lr == pytest.approx(dense_lr, abs=0.01e-4)  # the table rounds to 4 digits
    assert hp.l2 == pytest.approx(l2, rel=1e-12)
    assert hp.embedding_lr == 1e-4


def test_baseline_rules():
    s = 64
    none = scale_hyperparameters("none", 1024 * s, 1024, 1e-3, 1e-2, 1e-5)
    sqrt = scale_hyperparameters("sqrt", 1024 * s, 1024, 1e-3, 1e-2, 1e-5)
    linear = scale_hyperparameters("linear", 1024 * s, 1024, 1e-3, 1e-2, 1e-5)
    assert (none.dense_lr, none.embedding_lr, none.l2) == (1e-3, 1e-2, 1e-5)
    assert (sqrt.dense_lr, sqrt.embedding_lr, sqrt.l2) == pytest.approx((8e-3, 8e-2, 1e-5))
    assert (linear.dense_lr, linear.embedding_lr, linear.l2) == pytest.approx((64e-3, 64e-2, 1e-5))
    with pytest.raises(ValueError, match="scaling.rule='cubic'"):
        scale_hyperparameters("cubic", 2048, 1024, 1e-3, 1e-3, 0.0)


def test_linear_warmup():
    assert [warmup_factor(t, 4) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0
    assert math.isclose(warmup_factor(9, 10), 1.0)
