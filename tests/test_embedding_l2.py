"""The lazy replay of the every-row L2 term (modules/optim/embedding_l2.py) against torch's own optimizers.

For each row on its own: a parameter with the loss λ‖w‖² (gradient 2λw), stepped by ``torch.optim`` /
TorchRec's ``RowWiseAdagrad`` once per missed step with that step's learning rate, from a non-zero
optimizer state (Adam: its step count set so the bias correction is the replayed iteration's). This
covers fused Adam too, which runs on CUDA only (the end-to-end comparison against the dense reference
is in tests/test_cowclip.py::test_l2_on_every_row).
"""

from __future__ import annotations

import pytest
import torch
from torchrec.optim import RowWiseAdagrad

from modules.optim.embedding_l2 import DecayRule, replay_decay

L2, EPS, BETAS = 0.3, 1e-7, (0.9, 0.99)


def _torch_reference(kind: str, w: torch.Tensor, states: list[torch.Tensor], first: int, count: int,
                     lrs: torch.Tensor, iteration0: int) -> torch.Tensor:
    p = torch.nn.Parameter(w.clone()[None])  # [1, d]: one row
    if kind == "sgd":
        opt = torch.optim.SGD([p], lr=1.0)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad([p], lr=1.0, eps=EPS)
        opt.state[p]["sum"].copy_(states[0][None])
    elif kind == "rowwise_adagrad":
        opt = RowWiseAdagrad([p], lr=1.0, eps=EPS)
        opt.state[p]["sum"].copy_(states[0].view(1, 1))
    else:
        opt = torch.optim.Adam([p], lr=1.0, betas=BETAS, eps=EPS)
        opt.state[p] = {"step": torch.tensor(float(iteration0 + first)), "exp_avg": states[0][None].clone(),
                        "exp_avg_sq": states[1][None].clone()}
    for j in range(first, first + count):
        opt.param_groups[0]["lr"] = float(lrs[j])
        opt.zero_grad()
        (L2 * (p ** 2).sum()).backward()
        opt.step()
    return p.detach()[0]


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_replay_matches_torch_optimizers(kind):
    gen = torch.Generator().manual_seed(0)
    rows, d, steps = 6, 4, 40
    w = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    states = {"sgd": [], "adagrad": [torch.rand(rows, d, generator=gen, dtype=torch.float64)],
              "rowwise_adagrad": [torch.rand(rows, generator=gen, dtype=torch.float64)],
              "adam": [0.1 * torch.randn(rows, d, generator=gen, dtype=torch.float64),
                       0.01 * torch.rand(rows, d, generator=gen, dtype=torch.float64)]}[kind]
    first = torch.tensor([0, 3, 5, 0, 12, 30])
    count = torch.tensor([0, 1, 7, 25, 3, 10])
    lrs = 0.01 + 0.05 * torch.rand(steps, generator=gen, dtype=torch.float64)
    want = [_torch_reference(kind, w[r], [s[r] for s in states], int(first[r]), int(count[r]), lrs, 4)
            for r in range(rows)]
    got_w, got_states = w.clone(), [s.clone() for s in states]
    replay_decay(got_w, got_states, DecayRule(kind, L2, EPS, BETAS), first, count, lrs, iteration0=4)
    torch.testing.assert_close(got_w, torch.stack(want), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_w[0], w[0])  # no missed step: unchanged
    assert not torch.allclose(got_w[3], w[3])


def test_absent_rows_decay_geometrically_under_adam_with_small_eps():
    """The mechanism the reference relies on: once 2λ|w| ≪ ε, Adam's step on a row that only gets 2λw
    is ≈ lr·2λ|w|/ε, so an absent row shrinks geometrically, by ≈ (1 − 2λ·lr/ε) per step (0.98 here)."""
    lam, lr, eps, n = 1e-5, 1e-4, 1e-7, 50
    w = torch.full((1, 8), 1e-3, dtype=torch.float64)
    m, v = torch.zeros(1, 8, dtype=torch.float64), torch.zeros(1, 8, dtype=torch.float64)
    replay_decay(w, [m, v], DecayRule("adam", lam, eps, (0.9, 0.999)), torch.tensor([0]), torch.tensor([n]),
                 torch.full((n,), lr, dtype=torch.float64))
    geometric = (1 - 2 * lam * lr / eps) ** n
    assert abs(float(w[0, 0]) / 1e-3 - geometric) < 0.1 * geometric, (float(w[0, 0]) / 1e-3, geometric)
