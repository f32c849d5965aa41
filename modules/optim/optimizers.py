"""Optimizer construction for the two parameter families.

* Embedding tables: fused into FBGEMM's backward (TorchRec ``apply_optimizer_in_backward``) when
  the kernel exists on the device — SGD, Adagrad, row-wise Adagrad everywhere, Adam on CUDA only.
  Otherwise (Adam on CPU) the tables are data-parallel with the DENSE kernel and a regular
  ``torch.optim`` optimizer updates them (dense gradient: O(table) per step, small tables only).
* Dense (MLP, linear, cross) parameters: a regular ``torch.optim`` optimizer stepped by Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Tuple

import torch
from torch import nn
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.optimizers import in_backward_optimizer_filter

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": torch.optim.Adam,
}
FUSED_ON_CPU = frozenset({"sgd", "adagrad", "rowwise_adagrad"})


@dataclass
class OptimizerSpec:
    """``optim.dense`` / ``optim.embedding``: one optimizer's name and settings."""

    name: str
    lr: float
    eps: float = 1e-8
    betas: Tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"name={self.name!r}: expected one of {sorted(OPTIMIZERS)}")
        if self.lr < 0:
            raise ValueError(f"lr={self.lr}: expected a learning rate >= 0")
        self.betas = tuple(self.betas)

    def torch_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.name != "sgd":
            kw["eps"] = self.eps
        if self.name == "adam":
            kw["betas"] = self.betas
        return kw

    def fused_kwargs(self) -> dict[str, Any]:
        """Keyword arguments FBGEMM's fused TBE optimizers take (``lr`` is renamed by TorchRec)."""
        kw: dict[str, Any] = {"lr": self.lr}
        if self.name != "sgd":
            kw["eps"] = self.eps
        if self.name == "adam":
            kw["beta1"], kw["beta2"] = self.betas
        return kw  # no weight_decay: the fused kernels ignore it (refused by pipeline.config.check_runnable)


def is_fusable(spec: OptimizerSpec, device_type: str) -> bool:
    return device_type == "cuda" or spec.name in FUSED_ON_CPU


def replicated_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything not updated inside the embedding backward (TorchRec's filter)."""
    return in_backward_optimizer_filter(model.named_parameters())


def build_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return OPTIMIZERS[spec.name](list(params), **spec.torch_kwargs())


class OptimizerChain(torch.optim.Optimizer):
    """Several optimizers stepped as one; the closure (forward + backward) runs once.

    Needed when the dense part and data-parallel embedding tables use different optimizer classes
    (e.g. Adagrad MLP, Adam embeddings). ``param_groups`` are the members' own group dicts, so
    learning-rate changes reach the member optimizers.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:  # noqa: D107
        self.optimizers = dict(optimizers)
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers.values() for g in o.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {p: s for o in self.optimizers.values() for p, s in o.state.items()}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers.values():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {name: o.state_dict() for name, o in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        for name, o in self.optimizers.items():
            o.load_state_dict(state_dict[name])

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(f'{k}={type(o).__name__}' for k, o in self.optimizers.items())})"
