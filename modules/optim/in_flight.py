"""A merge's traffic on a thread of its own while training goes on (``trainer.merging.overlap``).

gloo runs a collective on the calling thread's behalf and blocks it until the peers answer: a merge issued
from the training thread stops training for as long as its bytes take across the link. Issued from a
daemon thread over a process group of its own (the training thread's collectives, if any, keep theirs, so
both see the same order of calls on every rank), the bytes travel while the next steps compute; the result
is collected, and its error raised, on the training thread. A daemon thread never holds up the process's
exit (a peer lost mid-merge fails the run on the training thread; the thread dies with the process).
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class InFlight(Generic[T]):
    """``fn(*args)`` running on a daemon thread; :meth:`result` waits for it and returns or raises its outcome."""

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run, fn, args),
                                        name="merge-in-flight", daemon=True)  # in the sender's context: its counters
        self._thread.start()

    def _run(self, fn: Callable[..., T], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to the training thread by result()
            self._error = e

    @classmethod
    def landed(cls, value: T) -> "InFlight[T]":
        """A merge whose bytes already arrived (restored from a checkpoint): :meth:`result` returns ``value``."""
        done = cls.__new__(cls)
        done._value, done._error, done._thread = value, None, None
        return done

    def result(self) -> T:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
