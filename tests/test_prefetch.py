"""The prefetching iterator keeps order, propagates errors and stops its producer."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.data.prefetch import prefetch


def test_order_and_errors():
    assert list(prefetch(range(100), depth=3)) == list(range(100))

    def failing():
        yield 1
        raise ValueError("boom at 2")

    it = prefetch(failing())
    assert next(it) == 1
    with pytest.raises(ValueError, match="boom at 2"):
        next(it)


def test_early_close_stops_the_producer():
    produced = []

    def slow():
        for i in range(1000):
            produced.append(i)
            yield i

    it = prefetch(slow(), depth=1)
    assert next(it) == 0
    it.close()
    time.sleep(0.3)
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n < 10
    assert not any(t.name == "prefetch" and t.is_alive() for t in threading.enumerate())
