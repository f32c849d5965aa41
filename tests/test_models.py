"""Model math against explicit references, unsharded and under DistributedModelParallel."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modules.embedding.sparse_arch import FeatureSpec, wide_row_offsets
from modules.models.deepfm import DeepFM
from modules.models.layers import ConcatLinear, fm_interaction
from pipeline.data.batches import make_batch
from pipeline.data.store import SplitArrays
from tests.dist_utils import run_workers

SPEC = FeatureSpec(("I1", "I2"), ("a", "b", "c"), {"a": 10, "b": 7, "c": 20})


def _batch(n: int = 9, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = SplitArrays(rng.integers(0, 2, n).astype(np.int8), rng.normal(size=(n, 2)).astype(np.float32),
                         np.stack([rng.integers(0, s, n) for s in (10, 7, 20)], 1).astype(np.int32))
    return arrays, make_batch(arrays, np.arange(n), list(SPEC.categorical))


def _random_deepfm(seed: int = 0) -> DeepFM:
    torch.manual_seed(seed)
    model = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_fm_identity_against_pairwise_sum():
    emb = torch.randn(5, 7, 4, dtype=torch.float64)
    pairwise = sum((emb[:, i] * emb[:, j]).sum(-1) for i, j in itertools.combinations(range(7), 2))
    torch.testing.assert_close(fm_interaction(emb), pairwise)


def test_fm_backward_matches_autograd_of_the_pairwise_sum():
    emb = torch.randn(5, 7, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(fm_interaction, (emb,))  # the hand-written backward vs finite differences
    g = torch.randn(5, dtype=torch.float64)
    pairwise = sum((emb[:, i] * emb[:, j]).sum(-1) for i, j in itertools.combinations(range(7), 2))
    want, = torch.autograd.grad(pairwise, emb, g)
    got, = torch.autograd.grad(fm_interaction(emb), emb, g)
    torch.testing.assert_close(got, want)


def test_concat_linear_matches_linear_over_the_concatenation():
    torch.manual_seed(0)
    layer = ConcatLinear((6, 3, 2), 5).double()
    plain = torch.nn.Linear(11, 5).double()
    plain.load_state_dict(layer.state_dict())  # same parameters, same keys
    xs = [torch.randn(7, 6, dtype=torch.float64, requires_grad=True), torch.randn(7, 3, dtype=torch.float64),
          torch.randn(7, 2, dtype=torch.float64, requires_grad=True)]
    g = torch.randn(7, 5, dtype=torch.float64)
    layer(xs).backward(g)
    got = [layer.weight.grad, layer.bias.grad, xs[0].grad, xs[2].grad]
    for x in (xs[0], xs[2]):
        x.grad = None
    plain(torch.cat(xs, 1)).backward(g)
    want = [plain.weight.grad, plain.bias.grad, xs[0].grad, xs[2].grad]
    torch.testing.assert_close(layer(xs), plain(torch.cat(xs, 1)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="expects 3 inputs"):
        layer(xs[:2])


@pytest.mark.parametrize("regroup", [False, True], ids=["column-views", "regroup"])
def test_deepfm_forward_matches_hand_computation(regroup):
    model = _random_deepfm()
    if regroup:  # the path taken when the pooled keys come in another order than the groups
        model.sparse_arch._flat_keys = None
    arrays, batch = _batch()
    bags = model.sparse_arch.ebc.embedding_bags
    ids = torch.from_numpy(arrays.sparse.astype(np.int64))
    emb = torch.stack([bags[f"emb_{f}"].weight[ids[:, j]] for j, f in enumerate(SPEC.categorical)], 1).double()
    rows = wide_row_offsets(SPEC)  # each field's first-order weights: its rows of the shared table
    wide = sum(bags["wide"].weight[ids[:, j] + rows[f], 0] for j, f in enumerate(SPEC.categorical)).double()
    dense = batch.dense_features.double()
    fm = sum((emb[:, i] * emb[:, j]).sum(-1) for i, j in itertools.combinations(range(3), 2))
    deep = torch.cat([emb.flatten(1), dense], 1)  # the MLP over the concatenated input, layer by layer
    for layer in model.mlp:
        deep = F.linear(deep, layer.weight.double(), layer.bias.double()) if isinstance(layer, torch.nn.Linear) \
            else layer(deep)
    deep = deep.squeeze(1)
    linear = F.linear(dense, model.dense_linear.weight.double(), model.dense_linear.bias.double()).squeeze(1)
    want = wide + linear + fm + deep
    model.float()
    torch.testing.assert_close(model(batch.dense_features, batch.sparse_features).double(), want, rtol=1e-5, atol=1e-5)


def _sharded_forward_worker(rank: int, world_size: int, sharding_type: str) -> None:
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec

    reference = _random_deepfm()
    net = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8], device=torch.device("meta"))
    topology = TopologySpec(compute_device="cpu", sharding_types=[sharding_type])
    dmp, plan = shard_model(net, OptimizerSpec("adagrad", 0.1), topology, torch.device("cpu"))
    dmp.load_state_dict(reference.state_dict())
    _, batch = _batch(n=8, seed=1)
    # each rank feeds its half of the batch; outputs must equal the unsharded model's rows
    half = slice(rank * 4, rank * 4 + 4)
    arrays, _ = _batch(n=8, seed=1)
    local = make_batch(arrays, np.arange(8)[half], list(SPEC.categorical))
    got = dmp(local.dense_features, local.sparse_features)
    want = reference(batch.dense_features, batch.sparse_features)[half]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kinds = {p.sharding_type for p in plan.plan.plan["sparse_arch.ebc"].values()}
    assert kinds == {sharding_type}, kinds


def test_sharded_deepfm_matches_unsharded_on_two_ranks():
    for sharding_type in ("table_wise", "row_wise"):
        run_workers(_sharded_forward_worker, 2, sharding_type)


def _restore_worker(rank: int, world_size: int) -> None:
    import lightning as L

    from modules.optim.optimizers import OptimizerSpec, replicated_parameters
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec
    from pipeline.training.best_validation import BestValidation

    net = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8], device=torch.device("meta"))
    dmp, _ = shard_model(net, OptimizerSpec("adagrad", 0.5), TopologySpec(compute_device="cpu"), torch.device("cpu"))
    arrays, batch = _batch(n=8, seed=2)
    before = dmp(batch.dense_features, batch.sparse_features).detach()

    class _Module(L.LightningModule):
        model = dmp

    class _Trainer:
        sanity_checking, current_epoch, callback_metrics, loggers = False, 0, {"val/auc": torch.tensor(0.7)}, []

    cb = BestValidation(restore_best=True)
    cb.on_validation_end(_Trainer(), _Module())
    dense = torch.optim.SGD([p for _, p in replicated_parameters(dmp)], lr=0.5)
    for _ in range(2):  # fused embedding updates + dense updates
        dmp(batch.dense_features, batch.sparse_features).sum().backward()
        dense.step()
        dense.zero_grad()
    assert not torch.allclose(dmp(batch.dense_features, batch.sparse_features), before)
    cb.on_fit_end(_Trainer(), _Module())
    torch.testing.assert_close(dmp(batch.dense_features, batch.sparse_features).detach(), before)


def test_restore_best_weights_on_sharded_model():
    run_workers(_restore_worker, 2)


def _stacked_init_worker(rank: int, world_size: int) -> None:
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec

    states, outputs = {}, {}
    _, batch = _batch(n=16, seed=4)
    for stack in (False, True):
        torch.manual_seed(7)
        net = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8], device=torch.device("meta"), stack_tables=stack)
        dmp, _ = shard_model(net, OptimizerSpec("rowwise_adagrad", 0.1), TopologySpec(compute_device="cpu"),
                             torch.device("cpu"))
        states[stack] = {k.rsplit(".", 2)[-2]: v.local_shards()[0].tensor if hasattr(v, "local_shards") else v
                         for k, v in dmp.state_dict().items()}
        outputs[stack] = dmp(batch.dense_features, batch.sparse_features).detach()
    # the stacked table's rows are the tables' rows, one table after the other: the same draws
    per_table = torch.cat([states[False][f"emb_{f}"] for f in SPEC.categorical])
    assert torch.equal(states[True]["stacked"], per_table)
    assert torch.equal(states[True]["wide"], states[False]["wide"])
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=1e-6)


def test_stacked_tables_start_as_the_tables_they_stack():
    run_workers(_stacked_init_worker, 1)


def test_auto_stacking_is_decided_before_a_model_is_built_and_old_records_are_unstacked():
    from modules.models import ModelConfig, build_model

    with pytest.raises(ValueError, match="model.stack_tables=auto is decided"):
        build_model(ModelConfig(), SPEC)
    assert ModelConfig.from_saved({"name": "deepfm"}).stack_tables is False  # recorded before stack_tables
    assert ModelConfig.from_saved({"name": "deepfm", "stack_tables": True}).stack_tables is True


def test_deciding_auto_stacking_leaves_the_random_state_as_it_was():
    """``auto`` builds the unstacked model to place its tables; the run's model must still get the draws
    it would get with the resolved value set by hand."""
    from modules.models import ModelConfig
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.table_stacking import decide_stacking
    from modules.sharding.topology import TopologySpec

    torch.manual_seed(5)
    before = torch.get_rng_state()
    cfg, why = decide_stacking(ModelConfig(embedding_dim=8, mlp=[16]), SPEC, TopologySpec(compute_device="cpu"),
                               OptimizerSpec("rowwise_adagrad", 0.1))
    assert cfg.stack_tables is True, why
    assert torch.equal(torch.get_rng_state(), before)


def test_concat_linear_runs_under_bf16_autocast_close_to_fp32():
    """``addmm_`` is outside autocast's op list: the later blocks are cast to the output's dtype."""
    torch.manual_seed(0)
    layer = ConcatLinear((16, 3), 8)
    xs = [torch.randn(32, 16), torch.randn(32, 3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(xs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), layer(xs), rtol=0.05, atol=0.05)
