"""Scaling-rule arithmetic against the CowClip reference table (LargeBatchCTR README, Criteo DeepFM)."""

from __future__ import annotations

import math

import pytest
import torch

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


def test_the_embedding_lr_can_follow_its_own_rule():
    s = 16
    cowclip = scale_hyperparameters("cowclip", 1024 * s, 1024, 8e-4, 1e-4, 1e-5)
    for rule, times in (("rule", 1.0), ("fixed", 1.0), ("sqrt", 4.0), ("linear", 16.0)):
        hp = scale_hyperparameters("cowclip", 1024 * s, 1024, 8e-4, 1e-4, 1e-5, embedding_lr_rule=rule)
        assert (hp.dense_lr, hp.l2) == (cowclip.dense_lr, cowclip.l2)  # only the embedding column changes
        assert hp.embedding_lr == pytest.approx(1e-4 * times, rel=1e-12)
    assert scale_hyperparameters("sqrt", 4096, 1024, 1e-3, 1e-2, 0.0, "fixed").embedding_lr == 1e-2
    with pytest.raises(ValueError, match="scaling.embedding_lr='cube'"):
        scale_hyperparameters("none", 2048, 1024, 1e-3, 1e-3, 0.0, "cube")


def test_learning_rates_warm_up_each_family_over_its_own_steps_and_follow_the_factor():
    from pipeline.training.learning_rates import LearningRates

    rates = LearningRates(dense=1.0, embedding=0.1, dense_warmup_epochs=1.0, embedding_warmup_epochs=0.5,
                          steps_per_epoch=4)
    assert [rates.dense_at(t) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert [rates.embedding_at(t) for t in range(4)] == pytest.approx([0.05, 0.1, 0.1, 0.1])
    rates.factor = 0.5
    assert rates.dense_at(9) == 0.5 and rates.embedding_at(9) == pytest.approx(0.05)


def _fused_sgd_steps(rank: int, world: int) -> None:
    """A fused SGD table (FBGEMM updates it in the backward) under a 4-step embedding warmup: each step's update
    is −lr(t)·g, with lr(t) = 0.4·(t + 1)/4 — the rate reached the kernel."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec
    from pipeline.training.learning_rates import LearningRates

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4,
                                                            feature_names=["f"], pooling=PoolingType.SUM)],
                                 device=torch.device("meta"))
    dmp, _ = shard_model(torch.nn.ModuleDict({"ebc": ebc}), OptimizerSpec("sgd", 0.4), TopologySpec(compute_device="cpu"),
                         torch.device("cpu"))
    rates = LearningRates(dense=1.0, embedding=0.4, embedding_warmup_epochs=1.0, steps_per_epoch=4)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3]), torch.tensor([1]))
    weight = dmp.state_dict()["ebc.embedding_bags.t.weight"].local_shards()[0].tensor
    for step in range(6):
        rates.apply_fused(dmp, step)
        before = weight[3].clone()
        dmp.module["ebc"](kjt)["f"].sum().backward()  # d/dw of the row's sum: 1 per column
        assert torch.allclose(before - weight[3], torch.full((4,), 0.4 * min(1.0, (step + 1) / 4))), step


def test_the_embedding_warmup_reaches_fbgemms_fused_update():
    from tests.dist_utils import run_workers

    run_workers(_fused_sgd_steps, 1)


def test_auto_is_none_up_to_the_base_batch_and_above_sqrt_with_a_linear_embedding_lr():
    from modules.optim.scaling_rules import resolve_rule

    assert [resolve_rule("auto", s) for s in (0.5, 1, 2, 64)] == [("none", "rule"), ("none", "rule"),
                                                                  ("sqrt", "linear"), ("sqrt", "linear")]
    assert resolve_rule("auto", 16, "fixed") == ("sqrt", "fixed")  # an embedding LR rule set outright is kept
    assert resolve_rule("cowclip", 16) == ("cowclip", "rule")
    for batch in (512, 1024, 16384, 65536):
        s = batch / 1024
        auto = scale_hyperparameters("auto", batch, 1024, 8e-4, 1e-4, 1e-5)
        assert auto.dense_lr == pytest.approx(8e-4 * max(1.0, s) ** 0.5)
        assert auto.embedding_lr == pytest.approx(1e-4 * max(1.0, s)) and auto.l2 == 1e-5


@pytest.mark.parametrize("batch, warmup, expected", [(1024, None, 0.0), (512, None, 0.0), (2048, None, 1.0),
                                                     (65536, None, 1.0), (1024, 0.5, 0.5), (65536, 0.0, 0.0)])
def test_warmup_none_means_one_epoch_above_the_base_batch_only(batch, warmup, expected):
    for rule in ("auto", "sqrt", "none"):
        assert scale_hyperparameters(rule, batch, 1024, 1e-3, 1e-2, 0.0, warmup_epochs=warmup).warmup_epochs == expected


def test_the_default_leaves_a_run_at_its_optimizers_base_batch_as_tuned_and_scales_above_it():
    from pipeline.config import compose_run_config
    from pipeline.training.task import CTRTask

    for overrides, base in (([], 4096), (["optim=reference"], 1024)):
        for batch in (base // 2, base, 4 * base):
            cfg = compose_run_config([*overrides, f"trainer.batch_size={batch}"])
            assert (cfg.scaling.rule, cfg.scaling.base_batch_size) == ("auto", base)  # conf/config.yaml, conf/optim
            task = CTRTask(cfg, cfg.topology.for_world(1, 1))
            s = max(1.0, batch / base)  # auto: as tuned at or below the base batch; above, dense × √s, tables × s
            assert (task.rates.dense, task.rates.embedding) == pytest.approx((cfg.optim.dense.lr * s ** 0.5,
                                                                              cfg.optim.embedding.lr * s))
            assert task.rates.dense_warmup_epochs == (1.0 if batch > base else 0.0)


def test_auto_warns_where_it_was_not_measured_to_pay_off():
    from modules.optim.scaling_rules import auto_caveat

    assert "rowwise_adagrad tables' LR x16" in auto_caveat("auto", 16, "rowwise_adagrad")
    # Adam tables (what auto was chosen with), at or below the base batch, another rule, an embedding LR set outright
    for args in (("auto", 16, "adam"), ("auto", 1, "rowwise_adagrad"), ("sqrt", 16, "rowwise_adagrad"),
                 ("auto", 16, "rowwise_adagrad", "sqrt")):
        assert auto_caveat(*args) is None
