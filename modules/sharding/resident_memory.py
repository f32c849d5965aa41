"""What a CPU training process holds in memory, for the host budget (:mod:`modules.sharding.placement`)::

    held = RssAnon + RssFile − Σ_{m ∈ GPU libraries} (Rss(m) − Anonymous(m))

``RssAnon`` is the heap (it cannot be reclaimed without swap); ``RssFile`` the pages of the libraries' code and of
the data the process has mapped, which a memory limit counts as page cache and which the process keeps touching.
The subtracted term is the file-backed pages of GPU libraries (CUDA, cuBLAS, NCCL, Triton, ``libtorch_cuda``, …,
from ``/proc/self/smaps``): a CUDA build of torch maps and initialises them on import, on a CPU run too (~200–300 MB
with the pinned torch 2.14.1), and a CPU run never touches them again, so under a limit the kernel drops them
first. Counting them made the same run's budget move by ~215 MB with what the page cache held when it started
(docs/ssd_tier.md), and refused runs that fit. Their anonymous pages (relocated data) stay counted.
"""

from __future__ import annotations

import re

# paths of GPU libraries: pip's nvidia-* wheels, and torch's and Triton's CUDA parts
GPU_LIBRARY = re.compile(r"/nvidia/|/lib(?:cu(?:da|dnn|blas|fft|file|rand|solver|sparse|pti|dss)|nccl"
                         r"|nv(?:rtc|JitLink|ToolsExt|shmem|idia)|triton|torch_cuda|c10_cuda)[^/]*\.so[^/]*$")
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def gpu_library_file_bytes(smaps: str) -> int:
    """Bytes of file-backed resident pages of GPU libraries in ``smaps`` (the text of ``/proc/<pid>/smaps``)."""
    total, gpu, rss = 0, False, 0
    for line in smaps.splitlines():
        if _MAPPING.match(line):
            parts = line.split(maxsplit=5)
            gpu = len(parts) == 6 and bool(GPU_LIBRARY.search(parts[5].strip()))
        elif gpu and line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif gpu and line.startswith("Anonymous:"):
            total += (rss - int(line.split()[1])) * 1024
    return total


def own_resident_bytes() -> int:
    """What this process holds in memory (module docstring); 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            rss = sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("RssAnon:", "RssFile:")))
        with open("/proc/self/smaps") as f:
            return rss - gpu_library_file_bytes(f.read())
    except OSError:
        return 0
