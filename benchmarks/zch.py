"""Raw ids with zero-collision tables (``model.zch``) against a vocabulary with growth and eviction and against
hashing, at equal table rows, over drifting days.

The log: ``--days`` days of the synthetic Criteo generator (:mod:`pipeline.data.synthetic`) with ``drift``: each
day every field's ids climb ``drift × cardinality`` ranks (yesterday's head leaves, new ids enter at the tail),
each id keeping its click effect. Every method trains the days in turn with ``ctr daily`` (day N from day N − 1's
model) and is scored on day N + 1 before training it (the next-day AUC):

* ``vocab``: ``categorical=vocab`` (min_count 2) growing day by day, ``evict_after`` days;
* ``hash``: ``categorical=hash``, ``--rows`` buckets a table;
* ``zch-<policy>``: ``categorical=raw`` and ``model.zch.rows = --rows`` (TorchRec's MCH: lru, lfu, distance_lfu, or our ttl);

``--rows vocab`` (the default) gives every ZCH table the rows of the vocabulary's table on the last day (the
largest it grew to: ``evict_after`` keeps it bounded) and hashing their mean, so all methods hold about the same
rows;

the vocabulary and ZCH admit a value once seen ``--min-count`` times (``min_count``, ``model.zch.min_count``).

Reported per method: mean next-day AUC, preprocessing rows/s (every day's store: its ``seconds`` from the store's
meta, which times the whole preprocessing), training samples/s (mean of the days' runs), the tables' rows
(``vocab``: the mean of its tables' sizes on the last day, for comparison: it is not capped). All in one script,
one process per run, on this machine.

    python benchmarks/zch.py --days 4 --rows-per-day 400000 --drift 0.05             # rows: as the vocabulary's
    python benchmarks/zch.py --days 4 --rows-per-day 3000000 --zipf-exponent 1.05     # a longer tail: > 20M ids
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.csv as pacsv

from work_folder import ROOT, child_env  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))

from pipeline.data.synthetic import ARROW_SCHEMA, CHUNK_ROWS, SyntheticConfig, SyntheticCriteo  # noqa: E402


def write_days(folder: Path, days: int, rows: int, drift: float, seed: int, zipf_exponent: float = 1.1) -> list[Path]:
    """The drifting days as Criteo-layout TSV files (generated once)."""
    files = []
    folder.mkdir(parents=True, exist_ok=True)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    for d in range(days):
        path = folder / f"day{d}.tsv"
        files.append(path)
        if path.exists():
            continue
        gen = SyntheticCriteo(SyntheticConfig(rows=rows, seed=seed, day=d, drift=drift, zipf_exponent=zipf_exponent))
        tmp = path.with_suffix(".tmp")
        with pacsv.CSVWriter(str(tmp), ARROW_SCHEMA, write_options=options) as writer:
            for c in range(-(-rows // CHUNK_ROWS)):
                writer.write_table(gen.chunk(c, min(CHUNK_ROWS, rows - c * CHUNK_ROWS))[0].cast(ARROW_SCHEMA))
        os.replace(tmp, path)
    return files


def distinct_ids(files: list[Path]) -> int:
    """Distinct (field, value) pairs over all days (pyarrow's unique, field by field)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = [f"f{i}" for i in range(14, 40)]
    parts: dict[str, list] = {c: [] for c in columns}
    for path in files:
        table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(autogenerate_column_names=True),
                               parse_options=pacsv.ParseOptions(delimiter="\t"),
                               convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in columns},
                                                                    strings_can_be_null=True, include_columns=columns))
        for c in columns:
            parts[c].append(pc.unique(table.column(c)))
    return sum(len(pc.drop_null(pc.unique(pa.chunked_array(p)))) for p in parts.values())


def vocab_sizes(work: Path, days: int) -> dict[str, int]:
    """The vocabulary run's table sizes on its last day (rows with OOV and missing)."""
    meta = work / "vocab" / f"day_{days - 1}" / "model" / "model.json"
    if not meta.is_file():
        raise SystemExit("--rows vocab: run the vocab method first (it sizes the others' tables)")
    return json.loads(meta.read_text())["store"]["table_sizes"]


def run_method(name: str, settings: list[str], files: list[Path], work: Path, common: list[str]) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "pipeline.commands.daily", "data=criteo_kaggle",
           f"data.path=[{','.join(str(f) for f in files)}]", f"paths.cache_dir={work / 'cache' / name}",
           f"logger.tracking_uri=sqlite:///{work / name}.db", f"hydra.run.dir={out}", *common, *settings]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=child_env(), capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name}: ctr daily failed ({proc.returncode})")
    wall = time.perf_counter() - t0
    rows = [line.split("|") for line in (out / "next_day_auc.md").read_text().splitlines()[2:]]
    next_day = [float(r[4]) for r in rows if r[4].strip()]
    results = [json.loads((out / f"day_{d}" / "result.json").read_text()) for d in range(len(files))]
    stores = [json.loads(p.read_text()) for p in sorted((work / "cache" / name / "stores").glob("*/meta.json"))]
    prep = sum(sum(m["splits"].values()) for m in stores) / sum(m["seconds"] for m in stores)
    sizes = json.loads((out / f"day_{len(files) - 1}" / "model" / "model.json").read_text())["store"]["table_sizes"]
    return {"method": name, "next_day_auc": statistics.mean(next_day), "per_day": next_day,
            "preprocess_rows_s": prep, "train_samples_s": statistics.mean(r["samples_per_s"] for r in results),
            "rows_per_table": statistics.mean(sizes.values()), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=".cache/zch", help="folder for the days and runs (default: under the "
                        "current folder, kept: the vocab method sizes later runs' tables)")
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--rows-per-day", type=int, default=500_000)
    parser.add_argument("--rows", default="vocab",
                        help="table rows: a number (zch rows and hash buckets), or 'vocab': each zch table as many rows "
                             "as the vocabulary's table on the last day, hash buckets their mean (vocab runs first)")
    parser.add_argument("--rows-scale", type=float, default=1.0,
                        help="with --rows vocab: ZCH tables at this multiple of the vocabulary's rows (1: equal rows; "
                             "larger: room to spare, to tell what eviction costs from what admission costs)")
    parser.add_argument("--drift", type=float, default=0.05)
    parser.add_argument("--zipf-exponent", type=float, default=1.1,
                        help="of the ids' frequencies (the generator's default 1.1; lower: a longer tail, more ids)")
    parser.add_argument("--evict-after", type=int, default=1)
    parser.add_argument("--min-count", type=int, default=2,
                        help="occurrences before a value gets a row: the vocabulary's min_count and model.zch.min_count")
    parser.add_argument("--zch-min-count", type=int, default=None, help="model.zch.min_count alone (default: --min-count)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--methods", nargs="+", default=["vocab", "hash", "zch-lru", "zch-ttl"])
    parser.add_argument("--set", nargs="*", default=[], help="extra overrides for every run")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    files = write_days(work / "days", args.days, args.rows_per_day, args.drift, args.seed, args.zipf_exponent)
    print(f"{args.days} days x {args.rows_per_day:,} rows, drift {args.drift}, Zipf {args.zipf_exponent}: "
          f"{distinct_ids(files):,} distinct ids",
          flush=True)
    # scaling=none: the default optimizer's rates unscaled at 8,192, as docs/zch.md's numbers were measured
    common = ["trainer.max_epochs=1", "trainer.batch_size=8192", "scaling=none", "trainer.eval_batch_size=16384",
              "trainer.enable_progress_bar=false", "data.preprocess.split.method=sequential", *args.set]
    zch_min = args.min_count if args.zch_min_count is None else args.zch_min_count
    rows = 1000 if args.rows == "vocab" else int(args.rows)  # 'vocab': the default of tables the vocabulary lacks
    methods = {
        "vocab": [f"data.preprocess.evict_after={args.evict_after}", f"data.preprocess.min_count={args.min_count}"],
        "hash": ["data.preprocess.categorical=hash", f"data.preprocess.hash_buckets={rows}"],
        **{f"zch-{policy}": ["data.preprocess.categorical=raw", f"model.zch.rows={rows}", f"model.zch.eviction={policy}",
                             f"model.zch.min_count={zch_min}"] for policy in ("lru", "lfu", "distance_lfu")},
        "zch-ttl": ["data.preprocess.categorical=raw", f"model.zch.rows={rows}", "model.zch.eviction=ttl",
                    f"model.zch.ttl_days={args.evict_after}", f"model.zch.min_count={zch_min}"],
    }
    table = []
    for name in sorted(args.methods, key=lambda m: m != "vocab"):
        if args.rows == "vocab" and name != "vocab":
            sizes = vocab_sizes(work, len(files))
            if name == "hash":
                methods[name][-1] = f"data.preprocess.hash_buckets={round(sum(sizes.values()) / len(sizes))}"
            else:
                methods[name] += [f"+model.zch.tables.{t}={max(2, round(args.rows_scale * n) - 2)}" for t, n in sizes.items()]
        label = f"{name}-min{zch_min}" if name.startswith("zch") and args.zch_min_count is not None else name
        label += f"-x{args.rows_scale:g}" if name.startswith("zch") and args.rows_scale != 1 else ""
        r = run_method(label, methods[name], files, work, common)
        print(json.dumps(r), flush=True)
        table.append(r)
    print("\n| method | next-day AUC (mean) | per day | preprocess rows/s | train samples/s | rows/table (last day) |")
    print("|---|---:|---|---:|---:|---:|")
    for r in table:
        print(f"| {r['method']} | {r['next_day_auc']:.4f} | {', '.join(f'{a:.4f}' for a in r['per_day'])} | "
              f"{r['preprocess_rows_s']:,.0f} | {r['train_samples_s']:,.0f} | {r['rows_per_table']:,.0f} |")
    (work / "results.json").write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
