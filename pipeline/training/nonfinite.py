"""What a training step does with non-finite values: ``trainer.nonfinite`` = stop | skip.

A step is non-finite when its loss is NaN/±inf on any rank, or when any dense gradient is after the
backward (the embedding tables were already updated inside the backward then: FBGEMM's fused
optimizers). ``stop`` raises ``FloatingPointError`` naming the step; ``skip`` counts the step
(``skipped``) and tells the caller to skip the dense update. All ranks take the same decision (a max
all-reduce of the flag), so the collectives of the step stay matched — except where the ranks share no
collective between merges (k-step merging over replicated tables: ``lockstep`` false), where each rank decides
for itself: a round trip per check across a slow link would cost more than the rest of the step (under ``stop``
the other ranks then fail at the next merge, naming the rank that stopped).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from pipeline.runtime.launch import group_size


def anywhere(flag: torch.Tensor, lockstep: bool = True) -> bool:
    """True if ``flag`` holds on any rank (``lockstep`` false: on this one)."""
    flag = flag.detach().to(torch.float32).reshape(1)
    if lockstep and group_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


class NonFiniteGuard:
    """``lockstep()``: whether the ranks must take each step's decision together (asked at each check: a run
    knows once its model is built)."""

    def __init__(self, policy: str = "stop", lockstep: Callable[[], bool] = lambda: True) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"trainer.nonfinite={policy!r}: expected 'stop' or 'skip'")
        self.policy = policy
        self.lockstep = lockstep
        self.skipped = 0

    def _found(self, what: str) -> bool:
        if self.policy == "stop":
            raise FloatingPointError(f"Non-finite training: {what}. Set trainer.nonfinite=skip to skip such steps "
                                     f"(they are counted as train/skipped_nonfinite_steps).")
        self.skipped += 1
        return True

    def bad_loss(self, loss: torch.Tensor, where: str) -> bool:
        """True (skip the step) if the loss is non-finite on any rank; raises under ``stop``."""
        if anywhere(~torch.isfinite(loss), self.lockstep()):
            return self._found(f"the loss is {loss.item()} at {where}")
        return False

    def bad_gradients(self, grads: Iterable[torch.Tensor | None], where: str) -> bool:
        """True (skip the dense update) if any gradient is non-finite on any rank; raises under ``stop``."""
        present = [g for g in grads if g is not None]
        bad = torch.stack([~torch.isfinite(g).all() for g in present]).any() if present else torch.tensor(False)
        if anywhere(bad, self.lockstep()):
            return self._found(f"non-finite dense gradients at {where}; embedding tables were already updated in "
                               f"the backward")
        return False
