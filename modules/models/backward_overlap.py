"""The embedding lookups' backward on a second thread, beside the MLP's weight gradients (CPU training).

On the CPU, FBGEMM's backward with its fused optimizer is a serial loop over the unique rows for a table
read by several features (the stacked table and the first-order table are): ≈ 15 ms of DeepFM's ≈ 167 ms
step at batch 8,192 on 2 cores, during which one core waits (docs/throughput.md). Nothing in the backward
needs that loop's result, and the MLP's weight gradients do not feed it, so the two can run side by side:

    backward of the dense part, input gradients only:   g_l = ∂L/∂y_l ⊙ [y_l > 0],  ∂L/∂x_l = g_l W_l
        (each hidden layer leaves its weight gradient ∂L/∂W_l = g_lᵀ x_l pending)
    then, once ∂L/∂e (every lookup's output gradient) is complete:
        worker thread, 1 OpenMP thread:   autograd.backward(e, ∂L/∂e)   (pooling, hooks, FBGEMM + update)
        this thread:                      ∂L/∂W_l = Σ_c g_l[c]ᵀ x_l[c]   over row chunks c of the batch,
                                          1 thread while the worker runs, then all of them

How it sits in the autograd graph: :func:`overlap_lookup_backward` cuts the graph after the lookups
(the dense part reads detached copies) and joins the copies and the MLP's weights in one node,
:class:`_Join`, whose backward runs once the dense part has delivered every gradient of the copies. It
starts the lookups' own backward on the worker and returns the deferred weight gradients as the
weights' gradients, so they reach the parameters through autograd as any gradient does (accumulation
and gradient hooks unchanged). It returns only when the worker has finished: ``loss.backward()`` ends
with the tables updated, as without the overlap.

Same gradients up to float rounding (the weight gradient summed over fixed row chunks, the same chunks
whatever thread count computes each: reproducible run to run; the lookups' gradient and the tables'
update are the same computation).

**Beside, or first.** The worker thread gains only while the cores are the process's own: with another process
competing for them the overlap ran at 0.58× the plain backward's rate (13.4k against 23.0k samples/s on 2 cores).
So the join runs the lookups' backward either on the worker beside the weight gradients, or first on this thread
(all threads) and the weight gradients after it — the same chunks, the same sums, in the same order: the same bits
either way, so the choice changes no result. :class:`ConcurrencyTuner` makes the choice from the measured step time:
every ``PERIOD`` steps it runs ``PROBE`` steps the other way and keeps the way whose median step was shorter (by more
than ``MARGIN``). Applies to one training process with at least 2 intra-op threads, on
the CPU in fp32 or bf16 autocast, when the MLP's layers run on oneDNN (:mod:`modules.models.onednn_linear`: in bf16
the chunks' products are bf16 GEMMs summed in fp32); with several
processes the lookups' backward holds collectives, which must not run beside this thread's.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from statistics import median
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from modules.models.onednn_linear import MIN_ROWS, DeferSlot, add_weight_grad, compute_dtype, narrow

# Rows of the batch per weight-gradient product. Fixed, so the sum's order never depends on timing; small
# enough that the switch to all threads, when the worker ends, waits ≤ one chunk (512 rows of DeepFM's
# first layer: ≈ 1.8 ms on one core). On 2 cores of an AMD EPYC, MKL runs [400, 512] × [512, 416] on one
# thread at the rate of the whole product, on two at 1.5 % below it.
CHUNK_ROWS = 512

_executor: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    """One long-lived thread that runs the lookups' backward with one OpenMP / MKL thread of its own."""
    global _executor
    if _executor is None:
        threads = torch.get_num_threads()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookup-backward")
        executor.submit(torch.set_num_threads, 1).result()
        torch.set_num_threads(threads)  # set_num_threads also sets the count threads started later take
        _executor = executor
    return _executor


def _forget_worker() -> None:
    global _executor
    _executor = None  # a forked child has no thread behind the parent's executor


os.register_at_fork(after_in_child=_forget_worker)


class DeferredWeightGrads:
    """Weight gradients the MLP's layers leave pending: per weight ``W``, ``g`` [B, out] and the layer's
    input ``x`` [B, in], for ∂L/∂W = gᵀ x."""

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self.weights = list(weights)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {id(w): None for w in weights}

    def slot(self, weight: torch.Tensor) -> DeferSlot | None:
        """Where a layer's backward leaves ``(g, x)`` for ``weight``; None if ``weight`` is not deferred."""
        key = id(weight)
        if key not in self._pending:
            return None

        def put(g: torch.Tensor, x: torch.Tensor) -> None:
            self._pending[key] = (g, x)
        return put

    def compute(self, busy: Callable[[], bool]) -> list[torch.Tensor | None]:
        """∂L/∂W of each weight (None where nothing was left pending), as ``Σ_c g[c]ᵀ x[c]`` over chunks
        of :data:`CHUNK_ROWS` rows; on one thread while ``busy()``, then on all."""
        grads: list[torch.Tensor | None] = []
        chunks = []
        for w in self.weights:
            item = self._pending.pop(id(w), None)
            if item is None:
                grads.append(None)
                continue
            g, x = item
            out = torch.empty_like(w)
            rows = g.shape[0] if narrow(g, x) else CHUNK_ROWS  # a narrow input is one short product
            chunks += [(out, g[r:r + rows], x[r:r + rows], r == 0) for r in range(0, g.shape[0], rows)]
            grads.append(out)
        threads = torch.get_num_threads()
        single = threads > 1 and busy()
        if single:
            torch.set_num_threads(1)
        try:
            for out, g, x, first in chunks:
                if single and not busy():
                    torch.set_num_threads(threads)
                    single = False
                add_weight_grad(out, g, x, beta=0.0 if first else 1.0)
        finally:
            if single:
                torch.set_num_threads(threads)
        return grads


PERIOD, PROBE, MARGIN = 100, 3, 0.02


class ConcurrencyTuner:
    """Whether the lookups' backward runs beside the weight gradients (``beside``) or before them, decided from the
    step times (module docstring). Each training forward that defers is one step: its period is the time between two
    of them. ``clock``: seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock, self.beside, self.steps, self.switches = clock, True, 0, 0
        self._last: float | None = None
        self._times: dict[bool, list[float]] = {True: [], False: []}

    def step(self) -> bool:
        """Called at each training step's forward: records the period that ended; returns how this step's backward
        runs (True: beside)."""
        now = self.clock()
        if self._last is not None:
            self._times[self._mode(self.steps - 1)].append(now - self._last)
        self._last = now
        if self.steps % PERIOD == PERIOD - 1:  # a probe and the steps before it measured: keep the faster way
            mine, other = self._times[self.beside][-(PERIOD - PROBE - 1):], self._times[not self.beside][-PROBE:]
            if len(mine) >= PROBE and len(other) == PROBE and median(other) < (1 - MARGIN) * median(mine):
                self.beside, self.switches = not self.beside, self.switches + 1
            self._times = {True: [], False: []}
        self.steps += 1
        return self._mode(self.steps - 1)

    def _mode(self, step: int) -> bool:
        """Step ``step``'s way: the other one for the ``PROBE`` steps before each decision."""
        probing = PERIOD - PROBE - 1 <= step % PERIOD < PERIOD - 1
        return self.beside != probing


class _Overlap:
    """What :class:`_Join`'s backward needs: the lookups (still attached to their graph) and the weight
    gradients left pending; ``beside``: whether the lookups' backward runs on the worker beside them."""

    def __init__(self, lookups: Sequence[torch.Tensor], deferred: DeferredWeightGrads, beside: bool = True) -> None:
        self.lookups, self.deferred, self.beside = list(lookups), deferred, beside

    def run(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        roots = [(t, g) for t, g in zip(self.lookups, grads) if g is not None]
        self.lookups = []
        job: Future | None = None
        if roots and not self.beside:  # first, on this thread with all of its threads; the same sums after it
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
            return self.deferred.compute(busy=lambda: False)
        if roots:
            job = _worker().submit(torch.autograd.backward, [t for t, _ in roots], [g for _, g in roots])
        try:
            weight_grads = self.deferred.compute(busy=lambda: job is not None and not job.done())
        except BaseException:
            if job is not None:
                wait_for([job])  # nothing of the step may still run when the error surfaces
            raise
        if job is not None:
            job.result()  # the lookups' backward's own error, if any
        return weight_grads


class _Join(torch.autograd.Function):
    """Identity over the detached lookups; its backward is :meth:`_Overlap.run` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, overlap: _Overlap, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.overlap, ctx.n = overlap, n
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        overlap, ctx.overlap = ctx.overlap, None
        return (None, None) + (None,) * ctx.n + tuple(overlap.run(grads))


def applies(lookups: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`overlap_lookup_backward` overlaps: a backward will follow (grad mode, lookups that
    need gradients), fp32 lookups on the CPU, outside autocast or under bf16 autocast (where the MLP runs on oneDNN),
    ≥ 2 intra-op threads, one process, and weights whose gradients the MLP can defer."""
    return (bool(weights) and bool(lookups) and lookups[0].shape[0] >= MIN_ROWS and torch.is_grad_enabled()
            and any(t.requires_grad for t in lookups)
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in lookups)
            and compute_dtype() is not None and torch.get_num_threads() > 1
            and not (dist.is_initialized() and dist.get_world_size() > 1))


def overlap_lookup_backward(lookups: tuple[torch.Tensor | None, ...], mlp: Any, enabled: bool = True,
                            tuner: ConcurrencyTuner | None = None
                            ) -> tuple[tuple[torch.Tensor | None, ...], DeferredWeightGrads | None]:
    """``lookups`` (a sparse arch's outputs, None for an absent one) as the dense part should read them,
    and the :class:`DeferredWeightGrads` to hand to ``mlp`` (a :class:`modules.models.layers.MLP`);
    unchanged and None where the overlap does not apply (:func:`applies`) or is not ``enabled``. ``tuner``: decides
    whether this step's lookups' backward runs beside the weight gradients (None: always)."""
    present = [t for t in lookups if t is not None]
    weights = mlp.deferrable_weights()
    if not (enabled and applies(present, weights)):
        return lookups, None
    deferred = DeferredWeightGrads(weights)
    beside = tuner.step() if tuner is not None else True
    joined = iter(_Join.apply(_Overlap(present, deferred, beside), len(present),
                              *(t.detach() for t in present), *weights))
    return tuple(None if t is None else next(joined) for t in lookups), deferred
