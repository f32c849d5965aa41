"""Run an iterator one step ahead in a background thread (I/O and parsing overlap the consumer)."""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


def prefetch(items: Iterable[T], depth: int = 1) -> Iterator[T]:
    """Yield the items of ``items``, producing up to ``depth`` of them ahead in a daemon thread.

    An exception raised by the producer is re-raised in the consumer at the position it occurred.
    Closing the consumer early stops the producer at its next step.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((_DONE, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((_DONE, e))

    thread = threading.Thread(target=produce, daemon=True, name="prefetch")
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)
