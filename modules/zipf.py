"""The bounded Zipf (power-law) id-frequency model shared by the synthetic generator and the planner.

Ranks r = 1..n with P(r) ∝ r^(-a), approximated by the continuous power law x^(-a) on [1, n+1):

    F(x)    = (x^(1-a) - 1) / ((n+1)^(1-a) - 1)               (a ≠ 1;  ln x / ln(n+1) for a = 1)
    F⁻¹(u)  = ((n+1)^(1-a) - 1) · u + 1) ^ (1/(1-a))         (a ≠ 1;  (n+1)^u for a = 1)

F⁻¹(u) for u ~ U(0, 1), floored, draws a rank; F⁻¹(q) is where the hottest ranks carry a share q of
the draws.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def bounded_zipf_inverse_cdf(u: np.ndarray | float, n: int, a: float) -> np.ndarray | float:
    """F⁻¹(u) of the continuous power law x^(-a) on [1, n + 1) (see the module docstring)."""
    if abs(a - 1.0) < 1e-9:
        return np.exp(u * np.log(n + 1.0))
    return ((np.power(n + 1.0, 1.0 - a) - 1.0) * u + 1.0) ** (1.0 / (1.0 - a))


def zipf_coverage(rows: int, exponent: float, levels: Sequence[float] = (0.5, 0.8, 0.9, 0.95, 0.99)) -> dict[float, int]:
    """Hottest rows carrying each share of the accesses when ids follow a bounded Zipf law
    (:mod:`modules.zipf`, as in the synthetic generator): ⌈F⁻¹(q) − 1⌉ rows carry a share q."""
    return {q: min(rows, max(1, math.ceil(float(bounded_zipf_inverse_cdf(q, rows, exponent)) - 1))) for q in levels}
