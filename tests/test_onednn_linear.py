"""The MLP's hidden layers on oneDNN (modules/models/onednn_linear.py) against a float64 reference written
with plain ``F.linear`` / ``relu`` and autograd, and which kernel a forward actually runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from modules.models import onednn_linear
from modules.models.layers import MLP

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def _reference(mlp: MLP, xs: list[torch.Tensor]) -> torch.Tensor:
    """The same MLP in float64: the first layer over the concatenated inputs, then layer by layer."""
    h = torch.cat(xs, dim=1)
    for layer in mlp:
        h = F.linear(h, layer.weight.double(), layer.bias.double()) if isinstance(layer, torch.nn.Linear) \
            else torch.relu(h)
    return h


def _kernels(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("widths", [(24,), (24, 5)], ids=["linear", "concat-linear"])
def test_onednn_mlp_matches_float64_reference_forward_and_backward(widths):
    torch.manual_seed(0)
    rows = onednn_linear.MIN_ROWS + 37
    mlp = MLP(widths if len(widths) > 1 else widths[0], [32, 16], 1)
    base = torch.randn(rows, sum(widths) + 3)  # a wider array: the first input is a strided column view
    x0 = base[:, :widths[0]].detach().requires_grad_()
    xs = [x0] + [torch.randn(rows, w) for w in widths[1:]]  # the dense block needs no gradient
    g = torch.randn(rows, 1)
    out = mlp(xs if len(xs) > 1 else xs[0])
    out.backward(g)
    got = [out, x0.grad] + [p.grad for p in mlp.parameters()]

    ref_x0 = x0.detach().double().requires_grad_()
    ref = MLP(widths if len(widths) > 1 else widths[0], [32, 16], 1).double()
    ref.load_state_dict(mlp.state_dict())  # the same parameters, in float64
    want_out = _reference(ref, [ref_x0] + [x.double() for x in xs[1:]])
    want_out.backward(g.double())
    want = [want_out, ref_x0.grad] + [p.grad for p in ref.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_onednn_runs_where_it_applies_and_plain_kernels_elsewhere():
    torch.manual_seed(0)
    mlp = MLP(24, [32, 16], 1)
    big, small = torch.randn(onednn_linear.MIN_ROWS, 24), torch.randn(onednn_linear.MIN_ROWS - 1, 24)
    assert "mkldnn::_linear_pointwise" in _kernels(lambda: mlp(big))
    assert "mkldnn::_linear_pointwise" not in _kernels(lambda: mlp(small))  # small requests: addmm
    with torch.autocast("cpu", dtype=torch.bfloat16):  # trainer.precision=bf16-mixed: oneDNN's bf16 GEMM
        assert "mkldnn::_linear_pointwise" in _kernels(lambda: mlp(big))
    with torch.autocast("cpu", dtype=torch.float16):  # not this kernel's: plain layers
        assert "mkldnn::_linear_pointwise" not in _kernels(lambda: mlp(big))
    mlp.onednn = False
    assert "mkldnn::_linear_pointwise" not in _kernels(lambda: mlp(big))
    plain = mlp(big)
    mlp.onednn = True
    torch.testing.assert_close(mlp(big), plain, rtol=1e-5, atol=1e-6)  # same model, float rounding apart


def test_mlp_with_batch_norm_between_linear_and_relu_keeps_its_layers():
    torch.manual_seed(0)
    mlp = MLP(24, [32], 1, batch_norm=True)  # Linear → BatchNorm → ReLU: no (Linear, ReLU) pair to fuse
    x = torch.randn(onednn_linear.MIN_ROWS, 24)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = mlp(x)
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops["mkldnn::_linear_pointwise"] == 2 and "aten::native_batch_norm" in ops  # each Linear alone
    torch.testing.assert_close(got, mlp[3](mlp[2](mlp[1](mlp[0](x)))), rtol=1e-5, atol=1e-6)


def test_gradients_masked_in_place_only_where_no_one_else_holds_them():
    torch.manual_seed(0)
    rows = onednn_linear.MIN_ROWS + 5
    x = torch.randn(rows, 24, requires_grad=True)
    w, b = torch.randn(32, 24, requires_grad=True), torch.randn(32, requires_grad=True)
    g = torch.randn(rows, 32)
    grads = []
    for private in (False, True):
        given = g.clone()
        onednn_linear.linear([x], w, b, private=private).backward(given)
        grads.append([t.grad.clone() for t in (x, w, b)])
        for t in (x, w, b):
            t.grad = None
        assert torch.equal(given, g) != private  # the private gradient was masked where it was
    for a, c in zip(*grads):
        assert torch.equal(a, c)
    mlp = MLP(24, [32, 16], None)  # the last hidden layer's output is the caller's: its gradient too
    out = mlp(torch.randn(rows, 24))
    given = torch.randn_like(out)
    kept = given.clone()
    out.backward(given)
    assert torch.equal(given, kept)


def test_under_bf16_autocast_the_onednn_mlp_is_as_close_to_float64_as_autocasts_plain_layers():
    """bf16-mixed: oneDNN's bf16 GEMMs (bias and ReLU fused, ∂L/∂b summed in fp32) against the plain layers under
    the same autocast, each measured against float64: the same rounding points, so no larger error (gradients of
    the fp32 parameters arrive in fp32)."""
    torch.manual_seed(0)
    widths = (64, 13)
    mlp = MLP(widths, [96, 96], 1)
    plain = MLP(widths, [96, 96], 1, onednn=False)
    plain.load_state_dict(mlp.state_dict())
    ref = MLP(widths, [96, 96], 1, onednn=False).double()
    ref.load_state_dict(mlp.state_dict())
    xs = [torch.randn(512, w) for w in widths]
    target = torch.randn(512, 1)

    def run(model, dtype, autocast):
        inputs = [x.detach().clone().to(dtype).requires_grad_() for x in xs]  # fresh leaves each run
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(inputs)
        (out.to(dtype) - target.to(dtype)).pow(2).mean().backward()
        return [out.detach().double(), *(x.grad.double() for x in inputs), *(p.grad for p in model.parameters())]

    want = run(ref, torch.float64, False)
    ours, theirs = run(mlp, torch.float32, True), run(plain, torch.float32, True)
    assert all(g.dtype == torch.float32 for g in ours[3:])
    for a, b, w in zip(ours, theirs, want):
        err_ours, err_theirs = float((a - w).norm() / w.norm()), float((b - w).norm() / w.norm())
        assert err_ours < 0.1 and err_ours <= 1.5 * err_theirs + 1e-3, (err_ours, err_theirs)  # bf16: ~2^-8 a rounding
