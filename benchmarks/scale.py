"""How the pipeline grows with rows and with table size, on one CPU machine.

    python benchmarks/scale.py data --rows 5000000 20000000 45000000
    python benchmarks/scale.py tables --limit-gb 2 --fractions 0.25 1 2 4 8 --rows 1000000
    python benchmarks/scale.py tables --vocab-rows 4000000 --fractions 2 --max-steps 400 --set \
        data.preprocess.min_count=1 data.synthetic.zipf_exponent=1.05 "data.synthetic.cardinalities=[20000000,...]"

``data``: generated Criteo-format logs (Criteo Kaggle's per-field cardinalities, Zipf ids; the
synthetic generator) of each size, DeepFM dim 16, 1 epoch. Per size: preprocessing seconds, rows/s and
peak memory (a process of its own); training samples/s and peak memory; checkpoint write and read
seconds (a resume reads it); export seconds and peak memory; test AUC. The first size is the
baseline: each cost is also shown per row relative to it (1.00 = linear in rows).

``tables``: one model at ``fractions`` × the memory the run may use. Each ``ssd`` run is put in a
memory cgroup (cgroup v1, ``memory.limit_in_bytes``, which also caps the page cache) and told that
limit (``topology.ddr_cap_gb``): placement counts the process, keeps what fits in host memory, moves
the rest to files and gives the row cache what is left (docs/ssd_tier.md). The baseline is the same
model in host memory with no limit, in the same script. Two ways to size it:

* ``--limit-gb L`` (hashed): every table hashed to ``H`` rows so the tables total fraction × L, limit L.
  Hashing scatters the hot ids over the whole table (the worst case for pages; a row cache does not care).
* ``--vocab-rows N``: the log of N rows with its frequency-sorted vocabulary (ids by descending count,
  ``data.preprocess.categorical=vocab``, the default): hot rows are packed at the start of each
  table; the limit is the tables' size / fraction. ``--max-steps`` bounds each run. With ``--set
  data.preprocess.base_vocabulary=<a larger log's store> data.synthetic.day=1`` the table is that log's
  vocabulary (grown by the day's new values) trained on a new day: most rows not met, the hot ones packed.

Reported: samples/s and the ratio to the in-memory run; the row caches' size, hit rate (unique rows
of a step found in the cache), rows drawn (met for the first time: no disk read), MB read from and
written to the files, the files' allocated size on disk; peak anonymous memory and the cgroup's peak
(page cache included); wall seconds of each whole run — the in-memory run initialises every row before
it trains (outside its samples/s), the ``ssd`` run draws each row when it first meets it (inside its
samples/s), so the two walls compare the whole job. The disk's 4 KiB random-read rate (O_DIRECT) and sequential
write rate are measured at the end, for the I/O volume to be read against.

Peak memory: ``VmHWM`` (resident, file pages included) and the peak of ``RssAnon`` (anonymous memory
only: what the process itself holds), sampled every 20 ms from ``/proc``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from work_folder import ROOT, child_env  # noqa: E402  (beside this file)


def bytes_per_row(dim: int) -> int:
    """A table row with its row-wise Adagrad state, and its first-order (wide, 4 columns) row: float32."""
    return 4 * (dim + 1) + 4 * (4 + 1)


def measured(cmd: list[str], cgroup: Path | None = None, env: dict | None = None) -> dict:
    """Run ``cmd`` in the current folder (in ``cgroup`` if given); wall/user/sys seconds, major faults, peak VmHWM
    and RssAnon."""
    prefix = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] if cgroup else []
    t0 = time.perf_counter()
    proc = subprocess.Popen([*prefix, *cmd], cwd=Path.cwd(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(env))
    peak = {"anon": 0, "hwm": 0, "majflt": 0, "utime": 0, "stime": 0}
    tick = os.sysconf("SC_CLK_TCK")

    def sample() -> None:
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                peak["anon"] = max(peak["anon"], int(re.search(r"RssAnon:\s+(\d+)", status).group(1)))
                peak["hwm"] = max(peak["hwm"], int(re.search(r"VmHWM:\s+(\d+)", status).group(1)))
                peak["majflt"], peak["utime"], peak["stime"] = int(stat[9]), int(stat[11]) / tick, int(stat[12]) / tick
            except (OSError, AttributeError, IndexError):
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    return {"wall": time.perf_counter() - t0, "out": out, "anon_mb": peak["anon"] / 1024, "hwm_mb": peak["hwm"] / 1024,
            "majflt": peak["majflt"], "user": peak["utime"], "sys": peak["stime"]}


def train(args: list[str], run_dir: Path, cgroup: Path | None = None) -> dict:
    m = measured([sys.executable, "-m", "pipeline.commands.train", *args, f"hydra.run.dir={run_dir}",
                  "trainer.enable_progress_bar=false"], cgroup)
    m["result"] = json.loads((run_dir / "result.json").read_text())
    saved = re.findall(r"Checkpoint \S+ written in ([\d.]+) s", m["out"])
    read = re.findall(r"Checkpoint \S+ read in ([\d.]+) s", m["out"])
    m["save_s"] = float(saved[-1]) if saved else None
    m["load_s"] = float(read[-1]) if read else None
    return m


PREPARE = """
import json, shutil, sys, time
from pipeline.config import compose_run_config
from pipeline.data.sources import prepare_store, raw_files, store_dir
cfg = compose_run_config(sys.argv[2:])
raw_files(cfg.data, cfg.paths.cache_dir)  # generated first (and kept): not part of the preprocessing time
if sys.argv[1] == "rebuild":
    shutil.rmtree(store_dir(cfg.data, cfg.paths.cache_dir), ignore_errors=True)  # a cached store: built again
t0 = time.perf_counter()
store = prepare_store(cfg.data, cfg.paths.cache_dir)
print("PREPROCESS", time.perf_counter() - t0, sum(store.meta["splits"].values()))
print("TABLES", json.dumps(store.meta["table_sizes"]))
"""


def prepare(overrides: list[str], rebuild: bool = True) -> dict:
    """The store of the log ``overrides`` describe (``rebuild``: built again, timed), its size and its tables."""
    m = measured([sys.executable, "-c", PREPARE, "rebuild" if rebuild else "reuse", *overrides])
    seconds, rows = re.search(r"PREPROCESS ([\d.]+) (\d+)", m["out"]).groups()
    sizes = json.loads(re.search(r"TABLES (.*)", m["out"]).group(1))
    return {**m, "seconds": float(seconds), "rows": int(rows), "table_sizes": sizes}


def data_scale(args: argparse.Namespace) -> None:
    work = Path(args.work)
    rows_out = []
    for rows in args.rows:
        common = [f"paths.cache_dir={work / 'cache'}", f"data.synthetic.rows={rows}"]
        pre = prepare(common)
        run = work / f"data-{rows}"
        train_args = [*common, "trainer.max_epochs=1", f"trainer.checkpoint.dir={run / 'ckpt'}", "logger.log_model=false",
                      f"logger.tracking_uri=sqlite:///{work / 'mlflow.db'}", f"trainer.batch_size={args.batch_size}"]
        fit = train(train_args, run / "train")
        again = train([*train_args, "trainer.resume=auto"], run / "resume")  # reads the checkpoint, nothing to train
        export = measured([sys.executable, "-m", "pipeline.commands.export", f"checkpoint={run / 'ckpt'}", f"out={run / 'model'}"])
        rows_out.append({"rows": rows, "pre_s": pre["seconds"], "pre_rows_s": pre["rows"] / pre["seconds"],
                         "pre_mb": pre["hwm_mb"], "train_sps": fit["result"]["samples_per_s"],
                         "train_mb": fit["hwm_mb"], "train_anon_mb": fit["anon_mb"], "save_s": fit["save_s"],
                         "load_s": again["load_s"], "export_s": export["wall"], "export_anon_mb": export["anon_mb"],
                         "auc": fit["result"]["test_auc"]})
        print(json.dumps(rows_out[-1]), flush=True)
    base = rows_out[0]
    print("\n| rows | preprocess s | rows/s | peak MB | train samples/s | peak MB (anon) | ckpt write s | ckpt read s "
          "| export s (anon MB) | test AUC | cost per row vs first: preprocess / train / export |")
    print("|" + "---:|" * 11)
    for r in rows_out:
        scale = r["rows"] / base["rows"]
        per_row = (r["pre_s"] / base["pre_s"] / scale, base["train_sps"] / r["train_sps"],
                   r["export_s"] / base["export_s"])
        print(f"| {r['rows']:,} | {r['pre_s']:.1f} | {r['pre_rows_s']:,.0f} | {r['pre_mb']:,.0f} | "
              f"{r['train_sps']:,.0f} | {r['train_mb']:,.0f} ({r['train_anon_mb']:,.0f}) | {r['save_s'] or 0:.1f} | "
              f"{r['load_s'] or 0:.1f} | {r['export_s']:.1f} ({r['export_anon_mb']:,.0f}) | {r['auc']:.4f} | "
              f"{per_row[0]:.2f} / {per_row[1]:.2f} / {per_row[2]:.2f} |")


def memory_cgroup(limit_gb: float) -> Path:
    """A child memory cgroup (v1) of this process's one, limited to ``limit_gb`` (page cache included)."""
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if line.split(":")[1] == "memory")
    group = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / f"ctr-scale-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(int(limit_gb * 2**30)))
    return group


def random_read_iops(path: Path, seconds: float = 10.0) -> float:
    """4 KiB random reads per second from ``path`` with O_DIRECT (no page cache), one at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    blocks = os.fstat(fd).st_size // 4096
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        os.preadv(fd, [buf], random.randrange(blocks) * 4096)
        n += 1
    os.close(fd)
    return n / (time.perf_counter() - t0)


ROW_CACHE = re.compile(r"Row caches \(rank 0\): ([\d,]+) rows, ([\d,]+) MB; training: hit rate ([\d.]+) of ([\d,]+) "
                       r"row lookups, rows read ([\d,]+) \(([\d,]+) MB\), drawn ([\d,]+), written ([\d,]+) \(([\d,]+) MB\)")


def row_cache_line(out: str) -> dict:
    m = ROW_CACHE.search(out)
    if m is None:
        return {}
    n = [float(x.replace(",", "")) for x in m.groups()]
    return {"cache_rows": n[0], "cache_mb": n[1], "hit_rate": n[2], "read_mb": n[5], "drawn": n[6], "written_mb": n[8]}


def sequential_write_mb_s(folder: Path, mb: int = 512) -> float:
    """Buffered sequential write then fsync, MB/s (the rate write-back can reach)."""
    path = folder / "write-rate.tmp"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = mb / (time.perf_counter() - t0)
    path.unlink()
    return rate


def table_scale(args: argparse.Namespace) -> None:
    work = Path(args.work)
    group = memory_cgroup(64)
    lines, host = [], None
    try:
        for fraction in args.fractions:
            common = [f"paths.cache_dir={work / 'cache'}", "logger.log_model=false", f"trainer.batch_size={args.batch_size}",
                      f"model.embedding_dim={args.dim}",
                      f"logger.tracking_uri=sqlite:///{work / 'mlflow.db'}", "trainer.max_epochs=1"]
            if args.vocab_rows:
                data = [f"data.synthetic.rows={args.vocab_rows}", *args.set]
                sizes = prepare(data, rebuild=False)["table_sizes"]
                gib = sum(sizes.values()) * bytes_per_row(args.dim) / 2**30
                limit = gib / fraction
                common += [*data, f"trainer.max_steps={args.max_steps}"]
            else:
                bucket_bytes = 26 * bytes_per_row(args.dim)  # a bucket of each of the 26 categorical fields' tables
                buckets = int(fraction * args.limit_gb * 2**30 / bucket_bytes)
                data = [f"data.synthetic.rows={args.rows}", "data.preprocess.categorical=hash",
                        f"data.preprocess.hash_buckets={buckets}", *args.set]
                prepare(data, rebuild=False)
                gib, limit = buckets * bucket_bytes / 2**30, args.limit_gb
                common += data
            (group / "memory.limit_in_bytes").write_text(str(int((args.cgroup_gb or limit) * 2**30)))
            if host is None or not args.vocab_rows:  # the vocab model is the same at every fraction
                host = train([*common, "topology.ddr_cap_gb=0"], work / f"tables-{fraction}-host")  # all in memory
            ssd_dir = work / f"tables-{fraction}-ssd"
            shutil.rmtree(ssd_dir / "files", ignore_errors=True)  # an earlier run's tables: not this run's, and disk
            # told the truth: the run's memory is the cgroup's limit; placement moves what does not fit to files
            ssd = train([*common, f"topology.ssd.path={ssd_dir / 'files'}", f"topology.ddr_cap_gb={limit:.4f}",
                         f"topology.ssd.cache_policy={args.policy}", *args.ssd_set], ssd_dir / "run", group)
            ssd["cache"] = row_cache_line(ssd["out"])
            ssd["peak_mb"] = int((group / "memory.max_usage_in_bytes").read_text()) / 2**20
            (group / "memory.max_usage_in_bytes").write_text("0")
            files = sum(f.stat().st_blocks * 512 for f in (ssd_dir / "files").rglob("*") if f.is_file()) / 2**30  # tables and spill logs
            shutil.rmtree(ssd_dir / "files", ignore_errors=True)  # measured; 8x of a limit would otherwise stay on disk
            lines.append((fraction, gib, limit, host, ssd, files))
            print(f"fraction {fraction}: tables {gib:.2f} GiB, limit {limit:.2f} GiB: host "
                  f"{host['result']['samples_per_s']:,.0f}/s, ssd {ssd['result']['samples_per_s']:,.0f}/s "
                  f"{ssd['cache']}", flush=True)
        table_file = max((work / "cache").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
        iops = random_read_iops(table_file)
        write_rate = sequential_write_mb_s(work)
    finally:
        group.rmdir()
    print(f"\nMemory limit per run: cgroup, page cache included, and topology.ddr_cap_gb = the limit. Disk: "
          f"{iops:,.0f} random 4 KiB reads/s (O_DIRECT, one at a time), {write_rate:,.0f} MB/s sequential write "
          f"(fsync)\n")
    print("| tables / limit | tables GiB | limit GiB | in memory samples/s | ssd samples/s | ssd / memory | row cache MB "
          "| hit rate | rows drawn | read MB | written MB | files on disk GiB | peak anon MB | cgroup peak MB | wall s: memory "
          "| wall s: ssd |")
    print("|" + "---:|" * 16)
    for fraction, gib, limit, host, ssd, files in lines:
        h, s = host["result"]["samples_per_s"], ssd["result"]["samples_per_s"]
        c = ssd["cache"] or {"cache_mb": 0, "hit_rate": float("nan"), "drawn": 0, "read_mb": 0, "written_mb": 0}
        print(f"| {fraction:g}× | {gib:.2f} | {limit:.2f} | {h:,.0f} | {s:,.0f} | {s / h:.2f} | {c['cache_mb']:,.0f} "
              f"| {c['hit_rate']:.4f} | {c['drawn']:,.0f} | {c['read_mb']:,.0f} | {c['written_mb']:,.0f} | {files:.2f} "
              f"| {ssd['anon_mb']:,.0f} | {ssd['peak_mb']:,.0f} | {host['wall']:.0f} | {ssd['wall']:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("data")
    d.add_argument("--rows", type=int, nargs="+", default=[5_000_000, 20_000_000, 45_000_000])
    t = sub.add_parser("tables")
    t.add_argument("--limit-gb", type=float, default=3.0)
    t.add_argument("--fractions", type=float, nargs="+", default=[0.25, 1.0, 2.0])
    t.add_argument("--rows", type=int, default=2_000_000)
    t.add_argument("--vocab-rows", type=int, default=None, help="size by this log's vocabulary instead of hashing")
    t.add_argument("--max-steps", type=int, default=1000)
    t.add_argument("--dim", type=int, default=16, help="model.embedding_dim (the tables are sized with it)")
    t.add_argument("--cgroup-gb", type=float, default=None, help="the ssd run's cgroup limit (default: the limit "
                   "placement is told): more room than the run is told, to see whether memory pressure binds it")
    t.add_argument("--ssd-set", nargs="*", default=[], help="overrides for the ssd run only, e.g. "
                   "+topology.table_overrides.<table>.tier=ssd for every table")
    t.add_argument("--policy", default="lfu", choices=["lru", "lfu"], help="topology.ssd.cache_policy")
    t.add_argument("--set", nargs="*", default=[], help="more data overrides, e.g. data.synthetic.zipf_exponent=1.05 "
                   "'data.synthetic.cardinalities=[...]' data.preprocess.min_count=1 (large frequency-ordered vocabularies)")
    for q in (d, t):
        q.add_argument("--work", default=".cache/scale", help="folder for the logs, stores and runs (default: under "
                       "the current folder, kept: a large log is generated once)")
        q.add_argument("--batch-size", type=int, default=8192)
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    (data_scale if args.what == "data" else table_scale)(args)


if __name__ == "__main__":
    main()
