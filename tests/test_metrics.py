"""Evaluation metrics over ranks, and the optimizer chain, against independent computations."""

from __future__ import annotations

import torch
from sklearn.metrics import log_loss, roc_auc_score

from modules.optim.optimizers import OptimizerChain
from tests.dist_utils import run_workers


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=g) < 0.3).float()
    logits = labels * 0.8 + torch.randn(n, generator=g)
    return logits, labels


def _metrics_worker(rank: int, world_size: int) -> None:
    from pipeline.training.metrics import CTRMetrics

    sizes = [700, 0]  # rank 1 sees only padding (no real rows), as in a small last eval batch
    parts = [_data(n, seed=r) for r, n in enumerate(sizes)]
    m = CTRMetrics()
    for chunk in torch.split(torch.arange(sizes[rank]), 128) if sizes[rank] else [torch.arange(0)]:
        m.update(parts[rank][0][chunk], parts[rank][1][chunk])
    got = m.compute()
    logits = torch.cat([p[0] for p in parts]).double()
    labels = torch.cat([p[1] for p in parts]).numpy()
    prob = torch.sigmoid(logits).numpy()
    assert abs(got["auc"] - roc_auc_score(labels, prob)) < 1e-6, got
    assert abs(got["logloss"] - log_loss(labels, prob)) < 1e-5, got


def test_metrics_cover_all_ranks_including_an_empty_one():
    run_workers(_metrics_worker, 2)


def test_optimizer_chain_runs_the_closure_once_and_steps_every_member():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    a_ref, b_ref = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    chain = OptimizerChain({"dense": torch.optim.Adagrad([a], lr=0.1), "embedding": torch.optim.Adam([b], lr=0.01)})
    refs = [torch.optim.Adagrad([a_ref], lr=0.1), torch.optim.Adam([b_ref], lr=0.01)]
    calls = 0

    def closure():
        nonlocal calls
        calls += 1
        chain.zero_grad()
        loss = (a ** 2).sum() + (b ** 3).sum()
        loss.backward()
        return loss

    for _ in range(3):
        chain.step(closure)
        for o in refs:
            o.zero_grad()
        ((a_ref ** 2).sum() + (b_ref ** 3).sum()).backward()
        for o in refs:
            o.step()
    assert calls == 3
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(b, b_ref)
    assert len(chain.param_groups) == 2
    chain.param_groups[1]["lr"] = 0.5
    assert chain.optimizers["embedding"].param_groups[0]["lr"] == 0.5
