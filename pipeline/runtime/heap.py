"""glibc heap settings for training, and giving freed heap memory back (``mallopt``, ``malloc_trim``).

A training step allocates and frees the same large blocks every step (activations and gradients of
[8192, 400] floats, 13 MB each). A block above glibc's mmap threshold is a fresh ``mmap``: the kernel
zero-fills and faults in its 3,200 pages again, step after step. glibc's adaptive threshold moves such
blocks onto the heap once one is freed, but then trims the heap top whenever more than twice that
size is free, so blocks are still faulted in again on many steps (10 steps of six 13 MB blocks:
192k page faults when every block is mapped, 25k-192k with glibc's defaults from run to run).
:func:`keep_training_blocks` fixes the threshold at ``MMAP_THRESHOLD`` (32 MiB, the upper bound of
glibc's adaptive one) and the trim threshold at ``TRIM_THRESHOLD``: after the heap has settled (three
such steps) the blocks are reused with no page fault. 2-5 % more samples/s at batch 8,192, same
numbers; peak RSS of the benchmark runs did not grow (docs/throughput.md).

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
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h


def _libc_function(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def keep_training_blocks() -> bool:
    """Keep freed blocks of up to 32 MiB in the heap (see the module docstring); False where the C
    library has no ``mallopt`` or refuses a setting."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(_MALLOPT(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim() -> None:
    if _TRIM is not None:
        _TRIM(0)
