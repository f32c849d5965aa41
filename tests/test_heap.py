"""glibc heap settings for training: a step's large blocks are reused instead of faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.runtime import heap

STEPS = """
import resource, sys, torch
from pipeline.runtime import heap
if sys.argv[1] == "keep":
    assert heap.keep_training_blocks()
else:  # every block a fresh mmap, as glibc does whenever its adaptive threshold is below the block size
    assert heap._MALLOPT(heap._M_MMAP_THRESHOLD, 128 << 10)  # glibc's default threshold, fixed
def step():  # six [8192, 400] float blocks (13 MB each) alive together, then freed, as in a training step
    blocks = [torch.ones(8192, 400) for _ in range(6)]
    return sum(float(b[-1, -1]) for b in blocks)
for _ in range(3):  # the heap settles into its layout over the first steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(heap._MALLOPT is None, reason="needs glibc's mallopt")
def test_kept_blocks_are_not_faulted_in_again():
    """The kernel's page-fault counter, not the allocator, is the reference: 10 steps of 6 × 13 MB fault
    in ≈ 10 · 6 · 3,200 pages when every block is a fresh mmap, and next to none once they are kept."""
    mapped, kept = _page_faults("mmap"), _page_faults("keep")
    assert mapped > 10 * 6 * 13_000_000 // 4096 // 2, mapped  # the reference really does re-fault
    assert kept < mapped / 20, (kept, mapped)
