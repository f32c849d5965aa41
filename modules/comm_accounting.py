"""Bytes of the collectives a rank actually issues, by category.

Wraps the ``torch.distributed`` collective functions that TorchRec and the model averaging call
from Python (``all_to_all_single``, ``all_reduce``, ``reduce_scatter_tensor``, ...) and counts the
payload each call sends: the input tensor's bytes (for ``all_to_all_single`` only the part sent to
other ranks; nothing over a group of one rank). DDP's gradient all-reduce runs in C++ and is
counted through a DDP communication hook (:func:`ddp_counting_hook`). A category — ``merge``,
``dense_allreduce``, otherwise ``embedding`` (TorchRec's input/output all-to-alls and
reduce-scatters) — is set with :func:`comm_category`. Counting is active between
:meth:`CommCounter.start` and ``stop``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

_category: contextvars.ContextVar[str] = contextvars.ContextVar("comm_category", default="embedding")
# the counters started in this context: a merge sent from a thread of its own (modules/optim/in_flight.py) runs in a
# copy of the context that sent it, so its bytes count to the step that sent them
_active: contextvars.ContextVar[tuple["CommCounter", ...]] = contextvars.ContextVar("comm_counters", default=())
# every started counter, for collectives issued from threads that did not inherit a context: the autograd engine's
# (on CUDA the backward, TorchRec's all-to-all's included, runs on a device thread of its own)
_started: list["CommCounter"] = []
WRAPPED = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
           "reduce_scatter", "all_gather", "all_to_all")
_originals: dict[str, Callable[..., Any]] = {}
# position of the ``group`` argument of each wrapped collective (when not passed by keyword)
_GROUP_ARG = {"all_reduce": 2, "all_to_all_single": 4, "reduce_scatter_tensor": 3, "all_gather_into_tensor": 2,
              "broadcast": 2, "reduce_scatter": 3, "all_gather": 2, "all_to_all": 2}


@contextlib.contextmanager
def comm_category(name: str) -> Iterator[None]:
    token = _category.set(name)
    try:
        yield
    finally:
        _category.reset(token)


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _sent_bytes(name: str, args: tuple, kwargs: dict) -> int:
    group = kwargs.get("group", args[_GROUP_ARG[name]] if len(args) > _GROUP_ARG[name] else None)
    if dist.get_world_size(group) == 1:
        return 0  # a group of one rank sends nothing
    if name == "all_to_all_single":
        inp = kwargs.get("input", args[1] if len(args) > 1 else None)
        splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        total = _nbytes(inp)
        if inp is None or not torch.is_tensor(inp):
            return 0
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if splits:
            row = total // max(1, inp.shape[0]) if inp.dim() else 0
            return total - int(splits[rank]) * row
        return total - total // world
    if name in ("all_gather", "all_to_all"):
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensor_list", kwargs.get("tensor")))
    if name == "reduce_scatter":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_list"))
    if name == "reduce_scatter_tensor":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
    if name == "all_gather_into_tensor":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensor"))
    return _nbytes(args[0] if args else kwargs.get("tensor"))


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counters = _active.get() or tuple(_started)
        if counters:
            n = _sent_bytes(name, args, kwargs)
            for counter in counters:
                counter.add(_category.get(), n)
        return fn(*args, **kwargs)

    return wrapper


def install() -> None:
    """Wrap ``torch.distributed``'s collectives so that started counters see their bytes (idempotent;
    :func:`uninstall` undoes it)."""
    for name in WRAPPED:
        if name not in _originals and hasattr(dist, name):
            _originals[name] = getattr(dist, name)
            setattr(dist, name, _wrap(name, _originals[name]))


def uninstall() -> None:
    """Put back the collectives :func:`install` wrapped."""
    while _originals:
        name, fn = _originals.popitem()
        setattr(dist, name, fn)


class CommCounter:
    """Bytes per category of the collectives issued while started (the collectives :func:`install`-ed)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)

    def add(self, category: str, n: int) -> None:
        self.bytes[category] += n

    def start(self) -> None:
        _active.set(_active.get() + (self,))
        _started.append(self)

    def stop(self) -> None:
        _active.set(tuple(c for c in _active.get() if c is not self))
        if self in _started:
            _started.remove(self)


def ddp_counting_hook(state, bucket):  # no annotations: DDP checks them against the real classes
    """DDP communication hook: ``state`` = (a hook of ``ddp_comm_hooks.default_hooks``: the plain all-reduce or an
    fp16/bf16 compressing one, the DDP's process group) on the bucket, its ``dist.all_reduce`` over that group (not
    all ranks: a DDP may span one node's) counted by the wrapper under the category ``dense_allreduce``."""
    hook, group = state
    with comm_category("dense_allreduce"):
        return hook(group, bucket)
