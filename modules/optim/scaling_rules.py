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

``auto`` picks the recipe for the batch (:func:`resolve_rule`): ``none`` at s ≤ 1; above, the dense LR × √s and
the embedding LR × s (``sqrt`` with ``embedding_lr=linear``). Chosen by wall time to the 1K run's validation
AUC (``benchmarks/time_to_auc.py``, docs/batch_scaling.md: 5M rows, Adam for both parts as the reference,
the 1K run 2 epochs, the large batches up to 4): it reached the 1K run's best − 0.001 at 16K and 64K on
both logs measured (1.6–10.3× sooner, two seeds each), where ``sqrt`` (the embedding LR × √s) and CowClip as
published (the embedding LR fixed) did not reach it. With few epochs the tables are what falls behind: a row met
in every batch gets s× fewer updates, and Adam's step does not grow with the summed gradient, so only the rate can
make it up. ``auto`` is the default; each optimizer config sets the base batch its rates are for, so a run at it is
left as tuned. (With row-wise Adagrad tables on CPU no recipe saved time above the base batch: docs/batch_scaling.md.)

``embedding_lr`` overrides the rule's embedding column: ``fixed`` (lr), ``sqrt`` (lr · √s) or ``linear``
(lr · s); ``rule`` keeps the rule's. CowClip with a scaled embedding rate is the recipe where the clip is what
makes a larger embedding step safe for frequent ids (issue: with a few epochs' budget, CowClip's fixed rate
moves the tables s× fewer steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RULES = ("none", "sqrt", "linear", "cowclip", "auto")
EMBEDDING_LR_RULES = ("rule", "fixed", "sqrt", "linear")


WARMUP_EPOCHS_ABOVE_BASE = 1.0  # ``warmup_epochs=None``: the dense LR's warmup when s > 1 (none at s ≤ 1)


@dataclass(frozen=True)
class ScaledHyperparameters:
    scale: float
    dense_lr: float
    embedding_lr: float
    l2: float
    warmup_epochs: float  # of the dense LR


def scale_hyperparameters(rule: str, batch_size: int, base_batch_size: int, dense_lr: float, embedding_lr: float,
                          l2: float, embedding_lr_rule: str = "rule",
                          warmup_epochs: float | None = 0.0) -> ScaledHyperparameters:
    """The rates and L2 for ``batch_size`` (table above); ``warmup_epochs=None``: one epoch of dense-LR warmup when
    the batch is above the base batch, none at or below it (``auto``'s: a run at the base batch is left as tuned)."""
    if rule not in RULES:
        raise ValueError(f"scaling.rule={rule!r}: expected one of {RULES}")
    if embedding_lr_rule not in EMBEDDING_LR_RULES:
        raise ValueError(f"scaling.embedding_lr={embedding_lr_rule!r}: expected one of {EMBEDDING_LR_RULES}")
    if batch_size <= 0 or base_batch_size <= 0:
        raise ValueError("batch sizes must be positive")
    s = batch_size / base_batch_size
    rule, embedding_lr_rule = resolve_rule(rule, s, embedding_lr_rule)
    if warmup_epochs is None:
        warmup_epochs = WARMUP_EPOCHS_ABOVE_BASE if s > 1 else 0.0
    dense_times, embedding_times, l2_times = {"none": (1.0, 1.0, 1.0), "sqrt": (math.sqrt(s), math.sqrt(s), 1.0),
                                              "linear": (s, s, 1.0), "cowclip": (math.sqrt(s), 1.0, s)}[rule]
    if embedding_lr_rule != "rule":
        embedding_times = {"fixed": 1.0, "sqrt": math.sqrt(s), "linear": s}[embedding_lr_rule]
    return ScaledHyperparameters(s, dense_lr * dense_times, embedding_lr * embedding_times, l2 * l2_times,
                                 warmup_epochs)


def resolve_rule(rule: str, s: float, embedding_lr_rule: str = "rule") -> tuple[str, str]:
    """(rule, embedding LR rule) that ``auto`` stands for at scale ``s`` (module docstring; an embedding LR rule
    set outright is kept); any other rule as it is."""
    if rule != "auto":
        return rule, embedding_lr_rule
    if s <= 1:
        return "none", embedding_lr_rule
    return "sqrt", "linear" if embedding_lr_rule == "rule" else embedding_lr_rule


def auto_caveat(rule: str, s: float, embedding_optimizer: str, embedding_lr_rule: str = "rule") -> str | None:
    """Why ``auto``'s recipe may not pay off for this run, or None: it was chosen with Adam tables, and with the
    default row-wise Adagrad on CPU no recipe saved time above the base batch (docs/batch_scaling.md)."""
    if rule != "auto" or s <= 1 or embedding_optimizer == "adam" or embedding_lr_rule != "rule":
        return None
    return (f"scaling=auto at {s:g}x the base batch scales the {embedding_optimizer} tables' LR x{s:g}: chosen with "
            f"Adam tables; with rowwise_adagrad on CPU no recipe saved time above the base batch and x16 lost 0.03 "
            f"AUC (docs/batch_scaling.md). Set scaling.embedding_lr or scaling=none to choose otherwise")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup: LR × (step + 1) / warmup_steps for the first ``warmup_steps`` steps, then × 1."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
