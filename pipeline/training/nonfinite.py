"""What a training step does with non-finite values: ``trainer.nonfinite`` = stop | skip.

A step is non-finite when its loss is NaN/±inf on any rank, or when any dense gradient is after the
backward (the embedding tables were already updated inside the backward then: FBGEMM's fused
optimizers). ``stop`` raises ``FloatingPointError`` naming the step; ``skip`` counts the step
(``skipped``) and tells the caller to skip the dense update. All ranks take the same decision (a max
all-reduce of the flag), so the collectives of the step stay matched.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from pipeline.runtime.launch import group_size


def anywhere(flag: torch.Tensor) -> bool:
    """True if ``flag`` holds on any rank."""
    flag = flag.detach().to(torch.float32).reshape(1)
    if group_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


class NonFiniteGuard:
    def __init__(self, policy: str = "stop") -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"trainer.nonfinite={policy!r}: expected 'stop' or 'skip'")
        self.policy = policy
        self.skipped = 0

    def _found(self, what: str) -> bool:
        if self.policy == "stop":
            raise FloatingPointError(f"Non-finite training: {what}. Set trainer.nonfinite=skip to skip such steps "
                                     f"(they are counted as train/skipped_nonfinite_steps).")
        self.skipped += 1
        return True

    def bad_loss(self, loss: torch.Tensor, where: str) -> bool:
        """True (skip the step) if the loss is non-finite on any rank; raises under ``stop``."""
        if anywhere(~torch.isfinite(loss)):
            return self._found(f"the loss is {loss.item()} at {where}")
        return False

    def bad_gradients(self, grads: Iterable[torch.Tensor | None], where: str) -> bool:
        """True (skip the dense update) if any gradient is non-finite on any rank; raises under ``stop``."""
        present = [g for g in grads if g is not None]
        bad = torch.stack([~torch.isfinite(g).all() for g in present]).any() if present else torch.tensor(False)
        if anywhere(bad):
            return self._found(f"non-finite dense gradients at {where}; embedding tables were already updated in "
                               f"the backward")
        return False
