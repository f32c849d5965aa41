"""Batch-size scaling rules for CTR training (Zheng et al., CowClip, AAAI 2023, Table 1 / §4).

With batch ``b = s · b0`` (``b0`` the base batch the base hyperparameters were tuned for):

=========  ==============  ===============  =========
rule       dense LR        embedding LR     L2 (λ)
=========  ==============  ===============  =========
none       lr              lr               λ
sqrt       lr · √s         lr · √s          λ
linear     lr · s         lr · s           λ
cowclip    lr · √s         lr (fixed)       λ · s
=========  ==============  ===============  =========

CowClip's ζ stays fixed. Reference (Criteo, DeepFM, b0 = 1024, dense lr 8e-4, λ 1e-5): 8K → 22.63e-4
and 8e-5; 32K → 45.25e-4 and 32e-5; 128K → 90.51e-4 and 128e-5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RULES = ("none", "sqrt", "linear", "cowclip")


@dataclass(frozen=True)
class ScaledHyperparameters:
    scale: float
    dense_lr: float
    embedding_lr: float
    l2: float


def scale_hyperparameters(rule: str, batch_size: int, base_batch_size: int, dense_lr: float,
                          embedding_lr: float, l2: float) -> ScaledHyperparameters:
    if rule not in RULES:
        raise ValueError(f"scaling.rule={rule!r}: expected one of {RULES}")
    if batch_size <= 0 or base_batch_size <= 0:
        raise ValueError("batch sizes must be positive")
    s = batch_size / base_batch_size
    if rule == "none":
        return ScaledHyperparameters(s, dense_lr, embedding_lr, l2)
    if rule == "sqrt":
        return ScaledHyperparameters(s, dense_lr * math.sqrt(s), embedding_lr * math.sqrt(s), l2)
    if rule == "linear":
        return ScaledHyperparameters(s, dense_lr * s, embedding_lr * s, l2)
    return ScaledHyperparameters(s, dense_lr * math.sqrt(s), embedding_lr, l2 * s)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup: LR × (step + 1) / warmup_steps for the first ``warmup_steps`` steps, then × 1."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
