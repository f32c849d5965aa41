"""Random 4 KiB page reads from a file: a memory map asked ahead with ``madvise(WILLNEED)`` (what the `ssd` tier's
sorted runs and table files do now: :mod:`modules.embedding.ssd_tier.paged_records`) against ``pread`` by T
threads, buffered and with ``O_DIRECT`` (issue 42: "Measure O_DIRECT or aligned pread/pwrite against mapped
files").

A file of ``--file-gb`` random bytes is written once. Each method reads the same ``--steps`` lists of
``--pages`` distinct pages (ascending, as a step's lookups ask them), each list from a cold page cache (the
file's pages dropped with ``posix_fadvise(DONTNEED)`` before it: the disk's rate, not memory's), and copies
them into one buffer; the bytes are checked against a read of the same pages by plain ``os.pread``. Printed
per method: pages/s (median over the steps, and the slowest step), CPU µs per page (this process's user +
system time: on 2 cores the CPU a read takes is what the training step loses), and how many of the file's
pages a step leaves in the page cache (``mincore`` after the step less before it, median: a mapped or
buffered read leaves its page there — the same bytes cached twice, once as a row and once as a page, and
counted by a memory cgroup; ``O_DIRECT`` leaves none).

Cold reads only. In training the page cache also serves run pages read again (other rows of a page met later):
end to end, lookups by ``O_DIRECT`` with 32 threads trained 20–25 % slower than the mapping on the
frequency-ordered case that reads most (docs/ssd_tier.md, "What did not work"), so the tier keeps the mapping.

    python benchmarks/page_reads.py                       # 4 GiB file, 10 steps of 40,000 pages
    python benchmarks/page_reads.py --threads 1 8 32 128 --dir /nvme/scratch
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modules.embedding import native_build  # noqa: E402
from modules.embedding.ssd_tier.paged_records import PAGE, page_ranges  # noqa: E402

SOURCE = Path(__file__).with_name("page_reads.c")  # read_pages (T threads of pread), resident_pages (mincore)


def library() -> ctypes.CDLL:
    lib = native_build.library(SOURCE)
    lib.resident_pages.restype = ctypes.c_int64
    return lib


def write_file(path: Path, gb: float) -> int:
    """A file of random bytes (written once, reused while its size matches); its number of pages."""
    pages = int(gb * 2**30) // PAGE
    if path.exists() and path.stat().st_size == pages * PAGE:
        return pages
    rng = np.random.default_rng(0)
    chunk = 1 << 26
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for _ in range(pages * PAGE // chunk):
            f.write(rng.integers(0, 2**63, chunk // 8, dtype=np.int64).tobytes())
        f.write(rng.integers(0, 2**63, (pages * PAGE % chunk) // 8, dtype=np.int64).tobytes())
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return pages


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return int(library().resident_pages(fd, ctypes.c_int64(path.stat().st_size)))
    finally:
        os.close(fd)


def mapped_reader(path: Path):
    """The tier's way: mapped without read-around, each step's pages asked ahead in runs of adjacent pages."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_RANDOM)
    view = {"flat": np.frombuffer(m, dtype=np.uint8).reshape(-1, PAGE)}

    def read(pages: np.ndarray, out: np.ndarray) -> None:
        for a, b in page_ranges(pages * PAGE, PAGE):
            m.madvise(mmap.MADV_WILLNEED, a * PAGE, (b - a) * PAGE)
        np.take(view["flat"], pages, axis=0, out=out)

    def close() -> None:
        view.clear()  # the array's hold on the mapping first
        m.close()
    return read, close


def pread_reader(path: Path, threads: int, direct: bool):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    lib = library()

    def read(pages: np.ndarray, out: np.ndarray) -> None:
        failed = lib.read_pages(fd, pages.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(len(pages)),
                                ctypes.c_int64(PAGE), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(threads))
        if failed:
            raise OSError(failed, os.strerror(failed), str(path))
    return read, lambda: os.close(fd)


def measure(name: str, reader, path: Path, steps: list[np.ndarray], check: list[np.ndarray]) -> dict:
    read, close = reader
    buf = mmap.mmap(-1, max(len(s) for s in steps) * PAGE)  # page-aligned, as O_DIRECT needs
    out_all = np.frombuffer(buf, dtype=np.uint8).reshape(-1, PAGE)
    rates, cpu, cached, out = [], 0.0, [], None
    try:
        for i, pages in enumerate(steps):
            drop(path)
            before = resident(path)
            out = out_all[:len(pages)]
            t0, c0 = time.perf_counter(), time.process_time()
            read(pages, out)
            rates.append(len(pages) / (time.perf_counter() - t0))
            cpu += time.process_time() - c0
            cached.append(resident(path) - before)
            if i < len(check) and not np.array_equal(out[:len(check[i])], check[i]):
                raise SystemExit(f"{name}: the pages read differ from os.pread's")
    finally:
        close()
        del out_all, out
        buf.close()
    return {"method": name, "median": statistics.median(rates), "slowest": min(rates),
            "cpu_us": 1e6 * cpu / sum(len(s) for s in steps), "cached": statistics.median(cached)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/ctr-page-reads"), help="where the file is written")
    p.add_argument("--file-gb", type=float, default=4.0)
    p.add_argument("--pages", type=int, default=40_000, help="distinct pages a step (the frequency-ordered 2× case "
                   "read back ~38,000 rows a step)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8, 32, 128], help="readers (at most 256)")
    p.add_argument("--rounds", type=int, default=2, help="every method this many times, in rotated order")
    p.add_argument("--keep", action="store_true", help="keep the file for the next run")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "pages.bin"
    t0 = time.perf_counter()
    n = write_file(path, args.file_gb)
    print(f"{path}: {n:,} pages ({n * PAGE / 2**30:.1f} GiB), ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(1)
    steps = [np.sort(rng.choice(n, args.pages, replace=False)).astype(np.int64) for _ in range(args.steps)]
    with open(path, "rb") as f:  # the reference bytes of the first 200 pages of the first steps
        check = [np.stack([np.frombuffer(os.pread(f.fileno(), PAGE, int(q) * PAGE), np.uint8) for q in s[:200]])
                 for s in steps[:2]]
    methods = {"mapped + madvise(WILLNEED) (the tier now)": lambda: mapped_reader(path)}
    for t in args.threads:
        methods[f"pread, buffered, {t} threads"] = lambda t=t: pread_reader(path, t, direct=False)
        methods[f"pread, O_DIRECT, {t} threads"] = lambda t=t: pread_reader(path, t, direct=True)
    results: dict[str, list[dict]] = {name: [] for name in methods}
    names = list(methods)
    try:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                results[name].append(measure(name, methods[name](), path, steps, check))
                print(f"  round {r + 1}: {name}: {results[name][-1]['median']:,.0f} pages/s", flush=True)
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    cpu = os.popen("grep -m1 'model name' /proc/cpuinfo").read().split(":")[-1].strip()
    print(f"\n{cpu}, {os.cpu_count()} cores; {args.steps} steps of {args.pages:,} random pages, each from a cold page "
          f"cache; rounds: {args.rounds}\n")
    print("| method | pages/s (median step), each round | slowest step | CPU µs a page | pages left in the page cache by a step |")
    print("|---|---:|---:|---:|---:|")
    for name, rs in results.items():
        print(f"| {name} | {', '.join(format(x['median'], ',.0f') for x in rs)} | {min(x['slowest'] for x in rs):,.0f} | "
              f"{statistics.median(x['cpu_us'] for x in rs):.1f} | {statistics.median(x['cached'] for x in rs):,.0f} |")


if __name__ == "__main__":
    main()
