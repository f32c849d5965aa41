"""What a training step does with non-finite values: ``trainer.nonfinite`` = stop | skip.

A step is non-finite when its loss is NaN/±inf on any rank, or when any dense gradient is after the
backward (the embedding tables were already updated inside the backward then: FBGEMM's fused
optimizers). ``stop`` raises ``FloatingPointError`` naming the step; ``skip`` counts the step
(``skipped``) and tells the caller to skip the dense update. The ranks a step's collectives span take the same
decision (a max all-reduce of the flag over ``group``), so those collectives stay matched: all ranks, or, with
k-step merging over copies of the tables, the ranks of one copy (a node's, or each rank alone), which share no
collective with the others between merges — a round trip per check across a slow link would cost more than the
rest of the step (under ``stop`` the other ranks then fail at the next merge, naming the rank that stopped).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from modules.host_collectives import host_group


def anywhere(flag: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True if ``flag`` holds on any rank of ``group`` (None: all ranks)."""
    flag = flag.detach().to("cpu", torch.float32).reshape(1)  # a host flag (modules/host_collectives.py)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group(group))
    return bool(flag.item() > 0)


class NonFiniteGuard:
    """``group()``: the ranks that take each step's decision together (None: all; asked at each check: a run
    knows once its model is built)."""

    def __init__(self, policy: str = "stop",
                 group: Callable[[], Optional[dist.ProcessGroup]] = lambda: None) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"trainer.nonfinite={policy!r}: expected 'stop' or 'skip'")
        self.policy = policy
        self.group = group
        self.skipped = 0

    def _found(self, what: str) -> bool:
        if self.policy == "stop":
            raise FloatingPointError(f"Non-finite training: {what}. Set trainer.nonfinite=skip to skip such steps "
                                     f"(they are counted as train/skipped_nonfinite_steps).")
        self.skipped += 1
        return True

    def bad_loss(self, loss: torch.Tensor, where: str) -> bool:
        """True (skip the step) if the loss is non-finite on any rank; raises under ``stop``."""
        if anywhere(~torch.isfinite(loss), self.group()):
            return self._found(f"the loss is {loss.item()} at {where}")
        return False

    def bad_gradients(self, grads: Iterable[torch.Tensor | None], where: str) -> bool:
        """True (skip the dense update) if any gradient is non-finite on any rank; raises under ``stop``."""
        present = [g for g in grads if g is not None]
        bad = torch.stack([~torch.isfinite(g).all() for g in present]).any() if present else \
            torch.tensor(False, device="cpu")
        if anywhere(bad, self.group()):
            return self._found(f"non-finite dense gradients at {where}; embedding tables were already updated in "
                               f"the backward")
        return False
