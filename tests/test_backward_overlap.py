"""The lookups' backward beside the MLP's weight gradients (modules/models/backward_overlap.py): the same
gradients as the plain backward, weight gradients against float64, which thread runs what, errors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from modules.models import onednn_linear
from modules.models.backward_overlap import CHUNK_ROWS, DeferredWeightGrads, overlap_lookup_backward
from modules.models.deepfm import DeepFM
from tests.test_models import SPEC, _batch

pytestmark = pytest.mark.skipif(not onednn_linear.AVAILABLE, reason="the overlap defers the oneDNN layers' gradients")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _deepfm(overlap: bool) -> DeepFM:
    torch.manual_seed(0)
    model = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8], overlap_embedding_backward=overlap)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


ROWS = 2 * CHUNK_ROWS + 37  # three row chunks, the last one short


def _grads(model: DeepFM, batch) -> dict[str, torch.Tensor]:
    model(batch.dense_features, batch.sparse_features).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _profiled(model: DeepFM, batch) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The gradients of a step, and how often each op ran on this thread (the profiler sees no other)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        grads = _grads(model, batch)
    return grads, {e.key: e.count for e in prof.key_averages()}


def test_overlapped_backward_gives_the_plain_backwards_gradients(two_threads):
    _, batch = _batch(ROWS)
    plain, overlapped = _deepfm(False), _deepfm(True)
    threads = []
    overlapped.sparse_arch.pooled.register_full_backward_hook(
        lambda *_: threads.append(threading.current_thread().name))
    (want, plain_ops), (got, ops) = _profiled(plain, batch), _profiled(overlapped, batch)
    assert threads and threads[0].startswith("lookup-backward")  # the lookups' backward ran on the worker
    # the hidden layers' weight gradients came from the join instead of their own backward (one product
    # per layer there, over the first layer's concatenated input): a product per row chunk for each layer
    assert ops["_JoinBackward"] == 1 and "_JoinBackward" not in plain_ops
    assert ops["aten::addmm_"] - plain_ops.get("aten::addmm_", 0) == 3 + 3
    assert plain_ops["aten::mm"] - ops["aten::mm"] == 2
    assert torch.get_num_threads() == 2
    for name, g in want.items():
        assert got[name] is not None, name
        if name.startswith("sparse_arch"):  # the lookups' gradient is the same computation
            assert torch.equal(got[name], g), name
        else:  # the weight gradients are summed over row chunks: float rounding
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-5, msg=name)


def _pending(weights, rows: int) -> tuple[DeferredWeightGrads, list]:
    """``(g, x)`` left for each weight but the last, as layers leave them; the last one's layer leaves
    nothing (it computed its own gradient)."""
    gen = torch.Generator().manual_seed(0)
    deferred, items = DeferredWeightGrads(weights), []
    for w in weights[:-1]:
        items.append((torch.randn(rows, w.shape[0], generator=gen), torch.randn(rows, w.shape[1], generator=gen)))
        deferred.slot(w)(*items[-1])
    return deferred, items


def test_deferred_weight_grads_match_float64_and_not_the_thread_timing(two_threads):
    weights = [torch.empty(24, 40), torch.empty(16, 8), torch.empty(5, 5)]  # a wide input, a narrow one
    rows = 2 * CHUNK_ROWS + 37
    deferred, items = _pending(weights, rows)
    assert deferred.slot(torch.empty(3)) is None  # not one of its weights
    got = deferred.compute(busy=lambda: False)
    assert got[2] is None  # nothing was left for it
    for (g, x), dw in zip(items, got):
        want = g.double().t() @ x.double()
        torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-4)
    # one thread throughout, or a switch to all threads after the first chunk or two: the same bits
    results = []
    for flips in (10**6, 0, 1, 2):
        calls = iter(range(10**6))
        again, _ = _pending(weights, rows)
        results.append(again.compute(busy=lambda flips=flips: next(calls) < flips))
        assert torch.get_num_threads() == 2
    for other in results[1:]:
        for a, b in zip(results[0][:2], other[:2]):
            assert torch.equal(a, b)


def test_an_error_in_the_lookups_backward_surfaces_from_backward(two_threads):
    _, batch = _batch(ROWS)
    model = _deepfm(True)

    def fail(*_):
        raise RuntimeError("hook failed in the lookups' backward")

    handle = model.sparse_arch.pooled.register_full_backward_hook(fail)
    with pytest.raises(RuntimeError, match="hook failed in the lookups' backward"):
        model(batch.dense_features, batch.sparse_features).sum().backward()
    assert torch.get_num_threads() == 2
    handle.remove()
    model.zero_grad()
    want = _grads(_deepfm(False), batch)  # the worker is still there for the next step
    got = _grads(model, batch)
    torch.testing.assert_close(got["mlp.0.weight"], want["mlp.0.weight"], rtol=1e-5, atol=1e-5)


def test_the_overlap_stays_out_where_it_does_not_apply(two_threads):
    _, batch = _batch(ROWS)
    model = _deepfm(True)
    lookups = model.sparse_arch(batch.sparse_features)

    def untouched() -> bool:
        out, deferred = overlap_lookup_backward(lookups, model.mlp, enabled=model.overlap_embedding_backward)
        return out is lookups and deferred is None

    assert not untouched()  # here it applies
    model.overlap_embedding_backward = False  # model.overlap_embedding_backward=false
    assert untouched()
    model.overlap_embedding_backward = True
    torch.set_num_threads(1)  # no second core to give the lookups' backward
    assert untouched()
    torch.set_num_threads(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed: the MLP on oneDNN in bf16, overlapped
        assert not untouched()
    with torch.autocast("cpu", dtype=torch.float16):  # the MLP is not on oneDNN under fp16 autocast
        assert untouched()
    with torch.no_grad():  # no backward follows
        lookups = model.sparse_arch(batch.sparse_features)
        assert untouched()


def test_the_lookups_backward_beside_or_first_gives_the_same_bits(two_threads):
    """The tuner may switch between the two ways at any step (another process on the cores): no result may change.
    Three training steps each way, from the same start: parameters and tables equal bit for bit."""
    from modules.models.backward_overlap import ConcurrencyTuner

    _, batch = _batch(ROWS)
    states = []
    for beside in (True, False):
        model = _deepfm(True)
        tuner = ConcurrencyTuner()
        tuner.beside = beside
        model.overlap_tuner = tuner
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(batch.dense_features, batch.sparse_features).pow(2).mean().backward()
            opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_the_tuner_keeps_the_way_whose_steps_are_shorter():
    """Steps of 100 ms beside and 60 ms first (the cores shared with another process): after its first probe the
    tuner runs them first; when beside becomes the faster again, it goes back. Probes are PROBE steps of the other
    way before each decision, every PERIOD steps."""
    from modules.models.backward_overlap import PERIOD, PROBE, ConcurrencyTuner

    cost = {True: 0.100, False: 0.060}
    now = [0.0]
    tuner = ConcurrencyTuner(clock=lambda: now[0])
    ways = []
    for _ in range(4 * PERIOD):
        way = tuner.step()
        ways.append(way)
        now[0] += cost[way]
        if len(ways) == 2 * PERIOD:
            cost = {True: 0.050, False: 0.060}  # the other process ended
    assert all(ways[:PERIOD - PROBE - 1]) and ways[PERIOD - PROBE - 1: PERIOD - 1] == [False] * PROBE  # the probe
    assert not any(ways[PERIOD: 2 * PERIOD - PROBE - 1])  # then first
    assert not any(ways[2 * PERIOD: 3 * PERIOD - PROBE - 1])  # the beside probe of the 2nd period lost: still first
    assert all(ways[3 * PERIOD: 4 * PERIOD - PROBE - 1])  # the other process gone: beside again after a probe
    assert tuner.switches == 2
