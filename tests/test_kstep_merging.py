"""k-step model merging on real DMP models over gloo processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from modules.embedding.sparse_arch import FeatureSpec
from modules.optim.kstep_merging import MergeConfig
from tests.dist_utils import run_workers

SPEC = FeatureSpec(("I1", "I2"), ("a", "b", "c"), {"a": 10, "b": 7, "c": 20})


def _setup(data_parallel: bool, seed: int = 0):
    from modules.models.deepfm import DeepFM
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model

    torch.manual_seed(seed)
    net = DeepFM(SPEC, embedding_dim=4, mlp=[8], device=torch.device("meta"))
    from modules.sharding.topology import TopologySpec

    topology = TopologySpec(compute_device="cpu", sharding_types=["table_wise"])
    dmp, _ = shard_model(net, OptimizerSpec("sgd", 0.05), topology, torch.device("cpu"), data_parallel=data_parallel)
    return dmp


def _batch(step: int, rank: int, n: int = 8):
    from pipeline.data.batches import make_batch
    from pipeline.data.store import SplitArrays

    rng = np.random.default_rng(1000 * step + rank)  # different data on every rank
    arrays = SplitArrays(rng.integers(0, 2, n).astype(np.int8), rng.normal(size=(n, 2)).astype(np.float32),
                         np.stack([rng.integers(0, s, n) for s in (10, 7, 20)], 1).astype(np.int32))
    return make_batch(arrays, np.arange(n), list(SPEC.categorical))


def _train_step(model, optimizer, step: int, rank: int) -> None:
    b = _batch(step, rank)
    loss = F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features), b.labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _replicated(model) -> list[torch.Tensor]:
    from modules.optim.optimizers import replicated_parameters

    return [p for _, p in replicated_parameters(model)]


def _same_everywhere(tensors: list[torch.Tensor], group=None) -> bool:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _k4_worker(rank: int, world: int, moments: bool) -> None:
    from modules.comm_accounting import CommCounter, install
    from modules.optim.kstep_merging import KStepMerger

    model = _setup(data_parallel=False, seed=rank)  # different init on purpose: the merger broadcasts
    params = _replicated(model)
    merger = KStepMerger(params, MergeConfig(k=4, moments=moments))
    assert _same_everywhere(params)
    optimizer = torch.optim.Adam(params, lr=0.01)
    merger.attach_optimizer(optimizer)
    install()  # in this worker process, which ends with the test
    counter = CommCounter()
    for step in range(1, 10):
        _train_step(model, optimizer, step, rank)
        counter.start()
        merged = merger.after_step()
        counter.stop()
        assert merged == (step % 4 == 0)
        assert _same_everywhere(params) == merged, step
        moments_state = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert _same_everywhere(moments_state) == (merged and moments), step
    payload = sum(p.numel() * p.element_size() for p in params)
    if moments:
        payload *= 3  # parameters + exp_avg + exp_avg_sq
    assert counter.bytes["merge"] == 2 * payload  # two merges in 9 steps


@pytest.mark.parametrize("moments", [False, True])
def test_k4_identical_after_merges_and_different_between(moments):
    run_workers(_k4_worker, 2, moments)


def _k1_worker(rank: int, world: int) -> None:
    from modules.optim.kstep_merging import KStepMerger

    sync = _setup(data_parallel=True)      # DDP: gradient all-reduce every step
    local = _setup(data_parallel=False)    # local SGD + parameter averaging every step
    local.load_state_dict(sync.state_dict())
    merger = KStepMerger(_replicated(local), MergeConfig(k=1))
    opt_sync = torch.optim.SGD(_replicated(sync), lr=0.1)
    opt_local = torch.optim.SGD(_replicated(local), lr=0.1)
    for step in range(5):
        _train_step(sync, opt_sync, step, rank)
        _train_step(local, opt_local, step, rank)
        merger.after_step()
    for a, b in zip(_replicated(sync), _replicated(local)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd_sync, sd_local = sync.state_dict(), local.state_dict()
    for key, value in sd_sync.items():  # the sharded tables saw the same gradients too
        if hasattr(value, "local_shards"):
            for x, y in zip(value.local_shards(), sd_local[key].local_shards()):
                torch.testing.assert_close(x.tensor, y.tensor, rtol=1e-5, atol=1e-6)


def test_k1_with_sgd_equals_synchronous_data_parallelism():
    run_workers(_k1_worker, 2)


def _hierarchical_worker(rank: int, world: int) -> None:
    from modules.optim.kstep_merging import KStepMerger

    model = _setup(data_parallel=False)
    params = _replicated(model)
    merger = KStepMerger(params, MergeConfig(k=4, k_intra=2), ranks_per_node=2)
    optimizer = torch.optim.SGD(params, lr=0.1)
    node_group = merger.node_group
    for step in range(1, 5):
        _train_step(model, optimizer, step, rank)
        merger.after_step()
        if step == 2:
            assert _same_everywhere(params, node_group) and not _same_everywhere(params)
        if step == 4:
            assert _same_everywhere(params)


def test_hierarchical_merging_two_nodes_of_two():
    run_workers(_hierarchical_worker, 4)


def _one_rank_group_worker(rank: int, world: int) -> None:
    from modules.comm_accounting import CommCounter, install

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    install()  # in this worker process, which ends with the test
    counter = CommCounter()
    t = torch.ones(10)
    counter.start()
    dist.all_reduce(t)  # over both ranks: 40 bytes sent
    dist.all_reduce(t, group=singles[rank])  # over this rank alone: nothing sent
    dist.broadcast(t, rank, singles[rank])
    counter.stop()
    assert dict(counter.bytes) == {"embedding": 40}


def test_collectives_over_a_group_of_one_rank_count_no_bytes():
    run_workers(_one_rank_group_worker, 2)


def _half_updates_worker(rank: int, world: int) -> None:
    from modules.comm_accounting import CommCounter, install
    from modules.optim.kstep_merging import KStepMerger

    exact = _setup(data_parallel=False, seed=rank)
    half = _setup(data_parallel=False, seed=rank)
    mergers = [KStepMerger(_replicated(m), MergeConfig(k=4), dense=d) for m, d in ((exact, "fp32"), (half, "fp16"))]
    optimizers = [torch.optim.Adam(_replicated(m), lr=0.01) for m in (exact, half)]
    install()  # in this worker process, which ends with the test
    counters = [CommCounter(), CommCounter()]
    for step in range(1, 9):
        for model, optimizer, merger, counter in zip((exact, half), optimizers, mergers, counters):
            _train_step(model, optimizer, step, rank)
            counter.start()
            merger.after_step()
            counter.stop()
        assert _same_everywhere(_replicated(half)) == (step % 4 == 0), step
        for a, b in zip(_replicated(exact), _replicated(half)):  # the mean, to fp16's precision of the updates
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    assert counters[1].bytes["merge"] * 2 == counters[0].bytes["merge"]  # the updates in half the bytes


def test_dense_updates_in_fp16_merge_to_the_fp32_mean_in_half_the_bytes():
    run_workers(_half_updates_worker, 2)


def _other_thread_worker(rank: int, world: int) -> None:
    import threading

    import torch.distributed as dist

    from modules.comm_accounting import CommCounter, install

    install()  # in this worker process, which ends with the test
    counter = CommCounter()
    counter.start()
    # a thread that did not inherit the step's context, as the autograd engine's device threads (on CUDA the
    # backward's all-to-alls run there): its collective still counts to the running step
    thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(256)))
    thread.start()
    thread.join()
    counter.stop()
    dist.all_reduce(torch.ones(256))  # after the step: counted nowhere
    assert dict(counter.bytes) == {"embedding": 256 * 4}


def test_collectives_from_threads_without_the_steps_context_are_counted():
    run_workers(_other_thread_worker, 2)
