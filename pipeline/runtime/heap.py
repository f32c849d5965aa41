"""Give freed heap memory back to the operating system (glibc ``malloc_trim``).

Evaluating with large batches (16K rows: activations of tens of MB per layer) leaves glibc's heap
holding freed blocks it does not return: on a 45M-row log the test pass of 4.5M rows grew the
process's anonymous memory from 1.1 GB to 7.2 GB, while the same pass with glibc's mmap threshold
pinned at 128 KiB stayed at 1.2 GB. ``malloc_trim(0)`` every ``EVERY`` evaluation batches releases it.
Elsewhere than glibc (no ``malloc_trim``) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

EVERY = 20


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim() -> None:
    if _TRIM is not None:
        _TRIM(0)
