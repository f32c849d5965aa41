"""fp32 against ``trainer.precision=auto`` (bf16-mixed where the CPU computes bf16), case by case, 2 seeds each.

    python benchmarks/precision.py                                   # every case (about 30 minutes on 2 cores)
    python benchmarks/precision.py --cases deepfm dcnv2 --seeds 1    # some of them

Each run is ``ctr train`` in its own process (2 threads), ``trainer.precision=32-true`` and ``auto`` alternating over
the same seeds (``seed=s``: initial weights and batch order), so the AUCs compare over the same draws. Cases:

* ``deepfm`` — the default DeepFM on 2M synthetic rows, batch 8,192;
* ``batch_65536`` — batch 65,536 with ``scaling=auto`` on 5M rows;
* ``cowclip`` — ``scaling=cowclip`` at batch 8,192 (CowClip's statistics stay fp32);
* ``dcnv2``, ``wide_deep`` — the other models on the 2M rows;
* ``multi_hot`` — a log with a multi-hot column (``tests/click_logs.py``: 400k rows);
* ``frappe`` — Frappe_x1 in the BARS setup (``+experiment=frappe_deepfm``; public DeepFM test AUC 0.98395).

``--fp16-tables`` (default: ``deepfm``): those cases run a third time, ``auto`` with ``model.table_precision=fp16``
(rows stored and updated in fp16, modules/embedding/table_precision.py), beside ``auto`` with fp32 rows: the tables'
bytes as each run planned them (its result.json: weights + optimizer state, and weights alone), samples/s, test AUC.

Beside ``deepfm``, the baseline: a plain PyTorch DeepFM (``benchmarks/reference_deepfm.py --layout shared``, one
shared table + SparseAdam) in fp32 and under ``torch.autocast("cpu", bfloat16)``, the strongest plain version a user
would write on such a CPU. Prints every run, then per case the mean samples/s ratio auto / fp32 and the mean |ΔAUC|;
where that exceeds ``MAX_AUC_LOSS`` the case is marked to keep fp32 under ``auto``. Work files go to ``--work``
(default: a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))
MAX_AUC_LOSS = 0.0005
SHARED = Path(os.environ.get("CTR_SHARED_DATA", ROOT.parent / "shared" / "data"))
CASES = {  # name: (overrides, the synthetic rows it needs or None)
    "deepfm": (["trainer.batch_size=8192"], 2_000_000),
    "batch_65536": (["trainer.batch_size=65536", "scaling=auto"], 5_000_000),
    "cowclip": (["trainer.batch_size=8192", "scaling=cowclip"], 2_000_000),
    "dcnv2": (["trainer.batch_size=8192", "model=dcnv2"], 2_000_000),
    "wide_deep": (["trainer.batch_size=8192", "model=wide_deep"], 2_000_000),
    "multi_hot": (["trainer.batch_size=4096", "trainer.max_epochs=2"], None),
    "frappe": (["+experiment=frappe_deepfm"], None),
}


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=child_env({"OMP_NUM_THREADS": "2"}), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc


def project(case: str, precision: str, seed: int, work: Path, tables: str = "fp32") -> dict:
    overrides, rows = CASES[case]
    data = [f"data.synthetic.rows={rows}"] if rows else []
    if case == "multi_hot":
        data = ["--config-dir", str(work / "conf"), "data=mylog", f"data.path={work / 'multi_hot.csv'}"]
    if case == "frappe":
        data = [f"data.path.train={SHARED / 'frappe_x1/train.csv'}", f"data.path.valid={SHARED / 'frappe_x1/valid.csv'}",
                f"data.path.test={SHARED / 'frappe_x1/test.csv'}"]
    folder = work / "runs" / f"{case}-{precision}-{tables}-{seed}"
    run([sys.executable, "-m", "pipeline.commands.train", *data, *overrides, f"trainer.precision={precision}",
         f"model.table_precision={tables}",
         f"seed={seed}", f"paths.cache_dir={work / 'cache'}", f"logger.tracking_uri=sqlite:///{work / 'mlflow.db'}",
         "logger.log_model=false", "trainer.enable_progress_bar=false", "trainer.num_threads=2",
         f"hydra.run.dir={folder}"], work)
    r = json.loads((folder / "result.json").read_text())
    return {"samples_per_s": r["samples_per_s"], "test_auc": r["test_auc"], "table_mib": r["table_bytes"] / 2**20,
            "weight_mib": r["table_weight_bytes"] / 2**20}


def baseline(precision: str, seed: int, work: Path) -> dict:
    from pipeline.config import compose_run_config
    from pipeline.data.sources import store_dir

    cfg = compose_run_config([f"data.synthetic.rows={CASES['deepfm'][1]}", f"paths.cache_dir={work / 'cache'}"])
    store = store_dir(cfg.data, cfg.paths.cache_dir)
    out = run([sys.executable, str(ROOT / "benchmarks" / "reference_deepfm.py"), str(store), "--batch", "8192",
               "--layout", "shared", "--seed", str(seed), "--precision", precision], work).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--fp16-tables", nargs="*", default=["deepfm"], choices=list(CASES),
                   help="cases also run with model.table_precision=fp16 (auto precision)")
    p.add_argument("--work", default=None, help="folder for the logs, stores and runs (default: a temporary one)")
    args = p.parse_args()
    with work_folder(args.work, "bench-precision-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    from loader import cpu_name  # beside this file
    from pipeline.training.precision import resolve_precision

    auto, why = resolve_precision("auto", "cpu")
    print(f"{cpu_name()}; auto resolves to {auto} ({why})\n", flush=True)
    if "multi_hot" in args.cases:
        from tests.click_logs import click_log, write_dataset
        click_log(400_000)[0].to_csv(work / "multi_hot.csv", index=False)
        write_dataset(work / "conf")
    results: dict[tuple[str, str], list[dict]] = {}
    print("| case | precision | seed | samples/s | test AUC |\n|---|---|---:|---:|---:|", flush=True)
    for case in args.cases:
        for seed in range(args.seeds):
            for precision in ("32-true", "auto"):
                r = project(case, precision, seed, work)
                results.setdefault((case, precision), []).append(r)
                print(f"| {case} | {precision} | {seed} | {r['samples_per_s']:,.0f} | {r['test_auc']:.6f} |",
                      flush=True)
            if case in args.fp16_tables:
                r = project(case, "auto", seed, work, tables="fp16")
                results.setdefault((case, "fp16_tables"), []).append(r)
                print(f"| {case} | auto, fp16 tables | {seed} | {r['samples_per_s']:,.0f} | {r['test_auc']:.6f} |",
                      flush=True)
            if case == "deepfm":
                for precision in ("fp32", "bf16"):
                    r = baseline(precision, seed, work)
                    results.setdefault(("plain", precision), []).append(r)
                    print(f"| plain PyTorch DeepFM | {precision} | {seed} | {r['samples_per_s']:,.0f} | "
                          f"{r['test_auc']:.6f} |", flush=True)
    print("\n| case | auto / fp32 samples/s | mean ΔAUC (auto − fp32) | mean abs ΔAUC | auto keeps |\n"
          "|---|---:|---:|---:|---|")
    for case in args.cases:
        a, f = results[(case, "auto")], results[(case, "32-true")]
        ratio = statistics.mean(x["samples_per_s"] / y["samples_per_s"] for x, y in zip(a, f))
        deltas = [x["test_auc"] - y["test_auc"] for x, y in zip(a, f)]
        loss = statistics.mean(abs(d) for d in deltas)
        keep = "fp32" if loss > MAX_AUC_LOSS else auto
        print(f"| {case} | {ratio:.2f}× | {statistics.mean(deltas):+.6f} | {loss:.6f} | {keep} |")
    if any(case in args.fp16_tables for case in args.cases):
        print("\n| case | tables MiB, fp32 → fp16 rows (with optimizer state) | weights alone | fp16 / fp32 rows "
              "samples/s | mean ΔAUC (fp16 − fp32 rows) | mean abs ΔAUC |\n|---|---|---|---:|---:|---:|")
    for case in (c for c in args.cases if c in args.fp16_tables):
        h, a = results[(case, "fp16_tables")], results[(case, "auto")]
        deltas = [x["test_auc"] - y["test_auc"] for x, y in zip(h, a)]
        print(f"| {case} | {a[0]['table_mib']:,.1f} → {h[0]['table_mib']:,.1f} "
              f"({h[0]['table_mib'] / a[0]['table_mib']:.2f}×) | {a[0]['weight_mib']:,.1f} → {h[0]['weight_mib']:,.1f} | "
              f"{statistics.mean(x['samples_per_s'] / y['samples_per_s'] for x, y in zip(h, a)):.2f}× | "
              f"{statistics.mean(deltas):+.6f} | {statistics.mean(abs(d) for d in deltas):.6f} |")
    if ("plain", "bf16") in results:
        a, b = results[("deepfm", "auto")], results[("plain", "bf16")]
        print(f"\nauto against the plain DeepFM under the same autocast: "
              f"{statistics.mean(x['samples_per_s'] / y['samples_per_s'] for x, y in zip(a, b)):.2f}× "
              f"(fp32 defaults against plain fp32: "
              f"{statistics.mean(x['samples_per_s'] / y['samples_per_s'] for x, y in zip(results[('deepfm', '32-true')], results[('plain', 'fp32')])):.2f}×)")


if __name__ == "__main__":
    main()
