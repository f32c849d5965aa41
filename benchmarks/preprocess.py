"""Preprocessing throughput and peak memory: this project's streaming preprocessor vs. pandas.

    python benchmarks/preprocess.py --rows 2000000            # also runs 2× the rows for the memory check
    python benchmarks/preprocess.py --rows 3000000 --no-double --methods project raw   # raw ids against the vocabulary

The 2× file is the 1× file written twice: the same vocabulary over twice the rows, so the memory
check isolates what preprocessing holds besides the vocabulary (which grows with the distinct ids).

For each file size, in one run on the same Criteo-format file (written by the synthetic generator):

* ``project``: ``pipeline.data.preprocess.preprocess`` (two streaming passes, vocabulary with
  min count 2, log1p, random split, memory-mapped store);
* ``pandas``: ``pandas.read_csv`` of the whole file (C parser) + ``factorize`` of every categorical
  column + log1p of the dense columns — the usual in-memory baseline, doing less work (no min count,
  no splits, nothing written).

Each method runs in a fresh subprocess and reports its own peak RSS (``VmHWM`` of
``/proc/self/status``: unlike ``ru_maxrss``, which Linux carries over from the parent through
fork and exec, it starts afresh with the new program); the file is read once beforehand, in chunks
(warm page cache) and each method runs ``--repeat`` times, alternating with the
other; the table shows medians. Prints rows/s, peak memory and the speed ratio project / pandas.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from work_folder import ROOT, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))


def run_project(path: str, out: str, categorical: str = "vocab") -> dict:
    from pipeline.data.dataset import builtin_layout
    from pipeline.data.preprocess import preprocess
    from pipeline.data.preprocess_config import PreprocessConfig

    t0 = time.perf_counter()
    store = preprocess([path], builtin_layout("criteo", PreprocessConfig(min_count=2, categorical=categorical)), out)
    return {"seconds": time.perf_counter() - t0, "rows": sum(store.meta["splits"].values())}


def run_pandas(path: str, out: str) -> dict:
    import numpy as np
    import pandas as pd

    from pipeline.data.dataset import builtin_layout

    CRITEO = builtin_layout("criteo")

    t0 = time.perf_counter()
    df = pd.read_csv(path, sep="\t", header=None, names=list(CRITEO.columns),
                     dtype={**{c: "float64" for c in CRITEO.numeric}, **{c: "object" for c in CRITEO.categorical}})
    codes = {c: pd.factorize(df[c])[0] for c in CRITEO.categorical}
    dense = np.log1p(np.maximum(df[list(CRITEO.numeric)].to_numpy(), 0))
    assert len(codes) == 26 and dense.shape[0] == len(df)
    return {"seconds": time.perf_counter() - t0, "rows": len(df)}


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):  # not Linux: the rusage peak (may include the parent's)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(64 << 20):
            pass


def _child(method: str, path: str, out: str) -> None:
    methods = {"project": run_project, "pandas": run_pandas,
               "raw": lambda p, o: run_project(p, o, "raw"), "hash": lambda p, o: run_project(p, o, "hash")}
    result = methods[method](path, out)
    result["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(result))


def measure(method: str, path: Path, workdir: Path) -> dict:
    out = workdir / f"store-{method}"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, __file__, "--child", method, str(path), str(out)],
                          capture_output=True, text=True, check=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="preprocessing benchmark")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--no-double", action="store_true", help="skip the 2× rows memory check")
    parser.add_argument("--workdir", default=None, help="folder for the logs (default: a temporary one, removed)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["pandas", "project"],
                        help="pandas | project (vocabulary) | raw (categorical=raw: no counting) | hash; the first is the baseline")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    with work_folder(args.workdir, "bench-preprocess-") as workdir:
        report(args, workdir)


def report(args: argparse.Namespace, workdir: Path) -> None:
    from pipeline.data.synthetic import SyntheticConfig, generate

    sizes = [args.rows] if args.no_double else [args.rows, 2 * args.rows]
    rows = []
    base = workdir / f"criteo-{args.rows}.tsv"
    if not base.exists():
        generate(SyntheticConfig(rows=args.rows, seed=7), base)
    for n in sizes:
        path = base if n == args.rows else workdir / f"criteo-{args.rows}-x2.tsv"
        if not path.exists():
            with open(path, "wb") as out:
                for _ in range(2):
                    with open(base, "rb") as src:
                        shutil.copyfileobj(src, out, 64 << 20)
        mb = path.stat().st_size / 2**20
        _warm(path)  # the page cache, for both methods
        runs: dict[str, list[dict]] = {m: [] for m in args.methods}
        for i in range(args.repeat):
            for method in (args.methods if i % 2 == 0 else args.methods[::-1]):
                r = measure(method, path, workdir)
                runs[method].append(r)
                print(f"  {method:8s} {n:>10,} rows: {r['seconds']:.1f} s, peak {r['peak_rss_mb']:.0f} MB", flush=True)
        for method, rs in runs.items():
            rows.append({"rows": n, "file_mb": mb, "method": method,
                         "seconds": statistics.median(r["seconds"] for r in rs),
                         "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs)})
    print()
    print(f"| rows | file MB | method | seconds | rows/s | peak RSS MB | speed vs {args.methods[0]} |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        base = next(x for x in rows if x["rows"] == r["rows"] and x["method"] == args.methods[0])
        print(f"| {r['rows']:,} | {r['file_mb']:.0f} | {r['method']} | {r['seconds']:.1f} | {r['rows'] / r['seconds']:,.0f} "
              f"| {r['peak_rss_mb']:.0f} | {base['seconds'] / r['seconds']:.2f}× |")
    if len(sizes) == 2:
        p1, p2 = (next(x for x in rows if x["rows"] == n and x["method"] == "project") for n in sizes)
        print(f"\nproject peak memory at 2× rows: {p2['peak_rss_mb'] / p1['peak_rss_mb']:.2f}× the 1× run")


if __name__ == "__main__":
    main()
