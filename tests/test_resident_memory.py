"""What the host budget counts as the process's own memory (modules/sharding/resident_memory.py)."""

import re
from pathlib import Path

from modules.sharding.resident_memory import gpu_library_file_bytes, own_resident_bytes

SMAPS = """\
7f0000000000-7f0000100000 r-xp 00000000 fd:01 11 /venv/site-packages/nvidia/cu13/lib/libcublasLt.so.13
Size:               1024 kB
Rss:                 600 kB
Pss:                 600 kB
Anonymous:            40 kB
7f0000100000-7f0000200000 r-xp 00000000 fd:01 12 /venv/site-packages/torch/lib/libtorch_cuda.so
Rss:                 300 kB
Anonymous:             0 kB
7f0000200000-7f0000300000 r-xp 00000000 fd:01 13 /venv/site-packages/torch/lib/libtorch_cpu.so
Rss:                 900 kB
Anonymous:            10 kB
7f0000300000-7f0000400000 r-xp 00000000 fd:01 14 /venv/site-packages/triton/_C/libtriton.so
Rss:                  70 kB
Anonymous:             2 kB
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
Rss:                 500 kB
Anonymous:           500 kB
7f0000500000-7f0000600000 r--p 00000000 fd:01 15 /data/store/nvidia_clicks.parquet
Rss:                 800 kB
Anonymous:             0 kB
7f0000600000-7f0000700000 r-xp 00000000 fd:01 16 /usr/lib/x86_64-linux-gnu/libcurl.so.4
Rss:                  20 kB
Anonymous:             0 kB
"""


def test_the_file_pages_of_gpu_libraries_are_summed_and_nothing_else():
    # cuBLASLt 600 − 40, libtorch_cuda 300 and Triton 70 − 2; libtorch_cpu, the heap, a data file named "nvidia…"
    # and libcurl (a CPU library whose name starts like CUDA's) stay counted
    assert gpu_library_file_bytes(SMAPS) == (560 + 300 + 68) * 1024


def test_this_process_is_counted_as_its_status_says_less_its_gpu_libraries_file_pages():
    import torch  # noqa: F401  (the pinned torch is a CUDA build: its libraries are mapped)

    status = Path("/proc/self/status").read_text()
    rss = sum(int(v) * 1024 for v in re.findall(r"^Rss(?:Anon|File):\s+(\d+) kB", status, re.M))
    smaps = Path("/proc/self/smaps").read_text()
    gpu = gpu_library_file_bytes(smaps)
    mapped = {line.split()[5] for line in smaps.splitlines() if re.match(r"^[0-9a-f]+-", line) and len(line.split()) > 5}
    if any("/nvidia/" in path or path.endswith("libtorch_cuda.so") for path in mapped):
        assert gpu > 0
    assert abs(own_resident_bytes() - (rss - gpu)) < 64 * 2**20  # read a moment apart
