"""Lightning callbacks of a training run, one per file. Order matters where a step's work feeds the
next one: :func:`pipeline.training.trainer.build_callbacks` lists them in the order they must run after
each training step (merge, count the bytes, checkpoint, stop on a signal)."""

from __future__ import annotations

from typing import Sequence, TypeVar

from lightning.pytorch.callbacks import Callback

C = TypeVar("C", bound=Callback)


def find_callback(callbacks: Sequence[Callback], cls: type[C]) -> C | None:
    """The run's callback of type ``cls`` (None if it has none)."""
    return next((c for c in callbacks if isinstance(c, cls)), None)

