"""An MLP layer, ``y = relu(b + Σ_k x_k W_kᵀ)`` (or without the ReLU), on oneDNN's fp32 GEMM for CPU training.

PyTorch's CPU ``addmm`` / ``mm`` call MKL's SGEMM for fp32. PyTorch also ships oneDNN, whose fp32
matmul it reaches through ``torch.ops.mkldnn._linear_pointwise`` (the op its inductor backend emits for
CPU linears); on the 2-core machines of this project it runs the MLP's [8192, 400] × [400, 400] GEMMs
in ≈ 13 ms against MKL's ≈ 15 ms, and fuses the bias and the ReLU into the GEMM (docs/throughput.md).
Same products, summed in another order: results equal up to float rounding.

Forward (one block or several, as :class:`modules.models.layers.ConcatLinear` splits ``W`` by columns)::

    x = [x_1 … x_K]                  one contiguous copy (oneDNN would copy a strided x_1 itself)
    y = relu(x Wᵀ + b)               one oneDNN GEMM, bias and ReLU fused (or y = x Wᵀ + b: the output layer)

Backward, with g = ∂L/∂y ⊙ [y > 0] (g = ∂L/∂y without the ReLU)::

    ∂L/∂x_k = g W_k        oneDNN (W_k transposed into a contiguous [in_k, out] copy: out·in_k floats)
    ∂L/∂W   = gᵀ x         MKL (oneDNN would need both [B, ·] operands transposed first: slower)
    ∂L/∂b   = Σ_rows g
    (∂L/∂W left to a later step of the backward where the lookups' backward overlaps it:
    :mod:`modules.models.backward_overlap`)

The copy of the blocks costs what oneDNN's own copy of DeepFM's strided lookups cost (≈ 0.8 ms at batch
8,192), and buys one GEMM each way instead of a separate product for the 13 dense features: their
weight gradient [13, 8192] × [8192, 400] alone took ≈ 2 ms, MKL being slow with 13 rows.

Under CPU bf16 autocast (``trainer.precision=bf16-mixed``) the same layer runs in bf16, as autocast would run a
plain ``Linear``: x, W and b cast to bf16 (W and b stay fp32 parameters: the master weights), oneDNN's bf16 GEMM
(products accumulated in fp32, the output rounded to bf16), ∂L/∂x and ∂L/∂W as bf16 GEMMs, ∂L/∂b summed in fp32;
the gradients reach the fp32 parameters as fp32. Same rounding points as autocast's plain layers, with the bias and
ReLU fused (≈ 10 % off the MLP's forward at batch 8,192 on 2 cores of a Zen 4, docs/throughput.md).

Used by :class:`modules.models.layers.MLP` where it applies (:func:`applies`): fp32 CPU tensors outside autocast,
or under CPU bf16 autocast, oneDNN present; elsewhere (CUDA, float64, fp16 autocast) the layers run as plain modules.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

DeferSlot = Callable[[torch.Tensor, torch.Tensor], None]  # takes (g, x) for ∂L/∂W = gᵀ x

_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
AVAILABLE = _linear is not None  # this PyTorch build has the op


# Below this many rows oneDNN's per-call set-up outweighs its faster kernel ([r, 400] × [400, 400] + ReLU,
# 1 thread: 1 row 29 µs vs addmm's 16 µs, 64 rows 216 vs 219 µs, 1,024 rows 2.97 vs 3.36 ms): serving's
# small requests keep addmm.
MIN_ROWS = 64


def compute_dtype() -> torch.dtype | None:
    """What :func:`linear` multiplies in here: fp32 outside autocast, bf16 under CPU bf16 autocast, else None."""
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32
    return torch.bfloat16 if torch.get_autocast_dtype("cpu") == torch.bfloat16 else None


def applies(xs: Sequence[torch.Tensor], weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs these inputs: fp32 (or, under bf16 autocast, bf16) on the CPU, rows in memory
    order (a strided view of another layout sends oneDNN to a reference kernel, orders of magnitude slower), at
    least :data:`MIN_ROWS` rows, fp32 parameters, outside autocast or under CPU bf16 autocast."""
    dtype = compute_dtype()
    return (AVAILABLE and dtype is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and xs[0].shape[0] >= MIN_ROWS
            and all(x.dtype in (torch.float32, dtype) and x.device.type == "cpu" and x.stride(-1) == 1 for x in xs))


def narrow(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ∂L/∂W = gᵀ x is taken as ``(xᵀ g)ᵀ``: for an input narrower than the layer's output, as MKL
    runs [400, 8192] × [8192, 13] at about half the rate of [13, 8192] × [8192, 400] (1.6 vs 0.9 ms)."""
    return x.shape[1] < g.shape[1]


def _weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``gᵀ x`` [out, in], the faster way round (:func:`narrow`)."""
    return x.t().mm(g).t() if narrow(g, x) else g.t().mm(x)


def add_weight_grad(out: torch.Tensor, g: torch.Tensor, x: torch.Tensor, beta: float) -> None:
    """``out ← β·out + gᵀ x`` in place, the faster way round (:func:`narrow`); β ∈ {0, 1}. A bf16 product (bf16
    ``g`` and ``x``, fp32 ``out``) is rounded to bf16 and summed into ``out`` in fp32."""
    if g.dtype != out.dtype:
        product = _weight_grad(g, x)
        out.copy_(product) if beta == 0 else out.add_(product)
        return
    if narrow(g, x):
        out.t().addmm_(x.t(), g, beta=beta)
    else:
        out.addmm_(g.t(), x, beta=beta)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool, defer: DeferSlot | None,
                private: bool, *xs: torch.Tensor) -> torch.Tensor:
        ctx.relu, ctx.defer, ctx.private, ctx.widths = relu, defer, private, [x.shape[1] for x in xs]
        dtype = compute_dtype() or torch.float32
        # one GEMM over [x_1 … x_K]: oneDNN copies a strided input (the lookups' columns of FBGEMM's output)
        # into a contiguous one anyway, and the copy is made here instead, with the other blocks in it (and cast)
        x = xs[0].to(dtype) if len(xs) == 1 else torch.cat([x.to(dtype) for x in xs], dim=1)
        weight = weight.to(dtype)  # under bf16 autocast a bf16 copy of the fp32 master weight
        bias = bias.to(dtype) if bias is not None else None
        y = _linear(x, weight, bias, "relu" if relu else "none", [], "")
        ctx.save_for_backward(weight, y if relu else None, x)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, y, x = ctx.saved_tensors
        if not ctx.relu:
            g = grad
        elif ctx.private and grad.is_contiguous():  # nothing else holds ∂L/∂y: masked where it is
            g = torch.ops.aten.threshold_backward.grad_input(grad, y, 0, grad_input=grad)
        else:
            g = torch.ops.aten.threshold_backward(grad, y, 0)
        need_w, need_b, _, _, _, *need_x = ctx.needs_input_grad
        grad_w = None
        if need_w and ctx.defer is not None:
            ctx.defer(g, x)  # computed later in the backward, beside the lookups' (backward_overlap)
        elif need_w:
            grad_w = _weight_grad(g, x)
        grad_b = g.sum(dim=0, dtype=torch.float32) if need_b else None  # (bf16 g: summed in fp32)
        grad_x = [_linear(g, w.t().contiguous(), None, "none", [], "") if need else None
                  for w, need in zip(weight.split(ctx.widths, dim=1), need_x)]
        return (grad_w, grad_b, None, None, None, *grad_x)


def linear(xs: Sequence[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = True,
           defer: DeferSlot | None = None, private: bool = False) -> torch.Tensor:
    """``relu(b + Σ_k x_k W_kᵀ)`` (``relu`` False: without the ReLU): ``xs`` K inputs [B, in_k], ``weight``
    [out, Σ in_k] (``W_k`` its column blocks), ``bias`` [out] or None → [B, out]. Only where
    :func:`applies`; for DeepFM's 400 → 1 output layer at batch 8,192, 0.61 against ``addmm``'s 1.26 ms.
    ``defer``: the backward hands ``(g, x)`` (x = [x_1 … x_K]) to it instead of computing ∂L/∂W
    (:mod:`modules.models.backward_overlap`).

    ``private``: the output goes only to later layers of the caller, so its gradient is a tensor no one
    else holds, and the backward applies the ReLU's mask to it in place instead of writing a new
    [B, out] tensor (batch 8,192 × 400: 0.67 against 1.1 ms, and the bias sum then reads it warm)."""
    return _Linear.apply(weight, bias, relu, defer, private, *xs)
