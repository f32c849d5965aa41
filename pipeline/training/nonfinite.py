"""What a training step does with non-finite values: ``trainer.nonfinite`` = stop | skip.

A step is non-finite when its loss is NaN/±inf on any rank, or when any dense gradient is after the
backward (the embedding tables were already updated inside the backward then: FBGEMM's fused
optimizers).

``stop`` (the default) notes each step's flags where they are computed — on the device, with no host read — and
reads them every ``trainer.nonfinite_check_every`` steps, and before every validation, checkpoint and the end of
training: the run then raises ``FloatingPointError`` naming the first non-finite step and the loss it had. The
steps between that one and the check did train on non-finite values (the run stops anyway; no checkpoint or model
is written from them, since each write is preceded by a check). On a GPU this takes two host synchronisations out
of every step.

``skip`` must decide before each update, so it reads its flag twice a step: the loss before the backward (a
non-finite loss is replaced by a zero one, so the fused embedding update applies nothing) and the dense gradients
before the dense update (skipped). The steps are counted (``skipped``).

The ranks a step's collectives span take the same decision (a max all-reduce of the flag over ``group``), so those
collectives stay matched: all ranks, or, with k-step merging over copies of the tables, the ranks of one copy (a
node's, or each rank alone), which share no collective with the others between merges — a round trip per check
across a slow link would cost more than the rest of the step (under ``stop`` the other ranks then fail at the next
merge, naming the rank that stopped).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from modules.host_collectives import host_group

LOSS, GRADIENTS = 0.0, 1.0  # what the first non-finite step had


def anywhere(flag: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True if ``flag`` holds on any rank of ``group`` (None: all ranks)."""
    flag = flag.detach().to("cpu", torch.float32).reshape(1)  # a host flag (modules/host_collectives.py)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group(group))
    return bool(flag.item() > 0)


def nonfinite_gradients(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A bool scalar on the gradients' device: any gradient holds a non-finite value."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.tensor(False, device="cpu")
    return torch.stack([~torch.isfinite(g).all() for g in present]).any()


class NonFiniteGuard:
    """``group()``: the ranks that take each decision together (None: all; asked at each check: a run knows once its
    model is built). ``check_every``: the steps between two reads of the noted flags under ``stop``."""

    def __init__(self, policy: str = "stop", group: Callable[[], Optional[dist.ProcessGroup]] = lambda: None,
                 check_every: int = 16) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"trainer.nonfinite={policy!r}: expected 'stop' or 'skip'")
        if check_every < 1:
            raise ValueError(f"trainer.nonfinite_check_every={check_every}: expected a number of steps >= 1")
        self.policy, self.group, self.check_every = policy, group, check_every
        self.skipped = 0
        self._first: torch.Tensor | None = None  # stop: [step, loss, what] of the first non-finite step; step -1: none

    # -- skip: a decision each step -------------------------------------------------------------
    def _skip(self, what: str) -> bool:
        if self.policy == "stop":
            raise FloatingPointError(f"Non-finite training: {what}. Set trainer.nonfinite=skip to skip such steps "
                                     f"(they are counted as train/skipped_nonfinite_steps).")
        self.skipped += 1
        return True

    def bad_loss(self, loss: torch.Tensor, step: int) -> bool:
        """``skip``: True (skip the step) if the loss is non-finite on any rank. ``stop``: noted, False."""
        bad = ~torch.isfinite(loss.detach())
        if self.policy == "stop":
            self._note(bad, step, loss.detach(), LOSS)
            return False
        return anywhere(bad, self.group()) and self._skip(f"the loss is {loss.item()} at step {step}")

    def bad_gradients(self, grads: Iterable[torch.Tensor | None], step: int) -> bool:
        """``skip``: True (skip the dense update) if any gradient is non-finite on any rank. ``stop``: noted, False."""
        bad = nonfinite_gradients(grads)
        if self.policy == "stop":
            self._note(bad, step, torch.zeros((), device=bad.device), GRADIENTS)
            return False
        return anywhere(bad, self.group()) and self._skip(
            f"non-finite dense gradients at step {step}; embedding tables were already updated in the backward")

    # -- stop: noted on the device, read every check_every steps -------------------------------------
    def _note(self, bad: torch.Tensor, step: int, value: torch.Tensor, what: float) -> None:
        device = bad.device
        if self._first is None or self._first.device != device:
            self._first = torch.full((3,), -1.0, dtype=torch.float64, device=device)
        # torch.full: a kernel launch with the numbers as arguments, no host→device copy to wait for
        new = torch.stack([torch.full((), float(step), dtype=torch.float64, device=device), value.double().reshape(()),
                           torch.full((), what, dtype=torch.float64, device=device)])
        self._first = torch.where(bad & (self._first[0] < 0), new, self._first)

    def step_done(self, step: int) -> None:
        """After training step ``step``: the noted flags are read every ``check_every`` steps."""
        if self.policy == "stop" and (step + 1) % self.check_every == 0:
            self.check()

    def check(self) -> None:
        """``stop``: raise if any rank noted a non-finite step since the start (one host read, one all-reduce)."""
        if self.policy != "stop" or self._first is None:
            return
        first = self._first.cpu()
        if not anywhere(first[0] >= 0, self.group()):
            return
        if first[0] < 0:
            self._skip("non-finite values on another rank")
        step = int(first[0])
        self._skip(f"the loss is {float(first[1])} at step {step}" if first[2] == LOSS else
                   f"non-finite dense gradients at step {step}; embedding tables were already updated in the backward")
