"""Training throughput: the project's pipeline vs. plain PyTorch DeepFMs and the dense-compute bound.

    python benchmarks/throughput.py --rows 2000000 --batch 8192 --epochs 1 --repeats 2 [--precision bf16-mixed]

Every run trains DeepFM (embedding dim 16, MLP 400-400-400, Adam for the dense part) on the same
preprocessed synthetic Criteo-format data, each in its own subprocess with the same number of threads:

* the project, through ``python -m pipeline.commands.train`` (TorchRec, Lightning, its data path,
  FBGEMM's fused row-wise Adagrad for the tables), with its defaults (``model.stack_tables=auto``, which
  stacks the one-id features' tables into one here: same model, one embedding backward) and with
  ``model.stack_tables=false`` (a table per feature, the default before), with ``model.onednn_mlp=false``
  (the MLP's hidden layers on PyTorch's default GEMM, MKL, instead of oneDNN) and with
  ``model.overlap_embedding_backward=false`` (the lookups' backward after the MLP's weight gradients
  instead of beside them, on a second thread);
* the baseline, ``benchmarks/reference_deepfm.py --layout shared``: one shared embedding table with
  per-field offsets, ``nn.Embedding(sparse=True)`` + SparseAdam — what a user would write;
* the weaker per-field baseline (an ``nn.Embedding`` per field), the one earlier numbers used;
* the bound: the MLP alone (forward, backward, Adam) at the same batch size and threads, and the same
  with the gradient of its embedding input (which any DeepFM computes: the bound it can reach), and that
  last bound with the project's own MLP layers (:class:`modules.models.layers.MLP`, oneDNN): its own dense
  compute.

All nine alternate in each of ``--repeats`` rounds (the machine's speed drifts between runs): the
defaults and the shared-table baseline run one after the other, in turns first, then the rest. Every
run of round i uses the seed ``--seed`` + i (initial weights, batch order), so the test AUCs compare runs
over the same seeds and their medians are not one draw's luck. Prints the median samples/s (training
only), peak RSS and test AUC of each, and per round the project's ratio (each variant) to the
shared-table baseline and to the bounds, with each run's test AUC.
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

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))


def _run_measured(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[str, float]:
    """Run a child in ``cwd`` under /usr/bin/time-like accounting: fork, exec, wait4 for its rusage."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.chdir(cwd)
        os.execvpe(cmd[0], cmd, env)
    os.close(w)
    chunks = []
    with os.fdopen(r) as fh:
        chunks.append(fh.read())
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed (exit {os.waitstatus_to_exitcode(status)})")
    return "".join(chunks), usage.ru_maxrss / 1024


VARIANTS = {"project (TorchRec + Lightning), defaults": [],
            "project, model.stack_tables=false": ["model.stack_tables=false"],
            "project, model.onednn_mlp=false": ["model.onednn_mlp=false"],
            "project, model.overlap_embedding_backward=false": ["model.overlap_embedding_backward=false"]}


def competitor(data_overrides: list[str], work: Path, env: dict[str, str]) -> subprocess.Popen:
    """A training of the defaults that outlasts the measured run; given 10 s to start training."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.commands.train", *data_overrides, "trainer.max_epochs=1000",
                             "logger.log_model=false", f"logger.tracking_uri=sqlite:///{work}/rival.db",
                             "trainer.enable_progress_bar=false", f"hydra.run.dir={work}/rival"], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(10)
    return proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="synthetic rows generated (85 %% train)")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="32-true", help="the project's trainer.precision (auto, bf16-mixed, ...); "
                   "where it is bf16-mixed the plain baselines run under the same bf16 autocast")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--work", default=None, help="folder for the data, stores and runs (default: a temporary one)")
    p.add_argument("--skip-reference", action="store_true", help="the project alone")
    p.add_argument("--repeats", type=int, default=1, help="alternate project and reference this many times")
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for the project run")
    p.add_argument("--seed", type=int, default=1, help="round i's seed (every run in it): seed + i")
    p.add_argument("--variants", nargs="+", default=["defaults", "stack_tables=false", "onednn_mlp=false",
                                                      "overlap_embedding_backward=false"],
                   help="the project's runs: defaults and any of the switches off (see VARIANTS)")
    p.add_argument("--compete", action="store_true", help="a second training (the defaults, on the same data) runs "
                   "beside every measured run, started 10 s before it: the cores shared with another process")
    args = p.parse_args()
    with work_folder(args.work, "bench-throughput-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    from pipeline.config import compose_run_config
    from pipeline.data.sources import prepare_store
    from pipeline.training.result import read_result

    from pipeline.training.precision import resolve_precision

    data_overrides = [f"data.synthetic.rows={args.rows}", f"paths.cache_dir={work / 'cache'}"]
    cfg = compose_run_config(data_overrides)
    store = prepare_store(cfg.data, cfg.paths.cache_dir)
    env = child_env({"OMP_NUM_THREADS": str(args.threads)})
    tmp = work
    precision, _ = resolve_precision(args.precision, args.device)
    project_cmd = [sys.executable, "-m", "pipeline.commands.train", *data_overrides, f"trainer.batch_size={args.batch}",
                   "scaling=none",  # the plain baselines' rates, unscaled
                   f"trainer.max_epochs={args.epochs}", f"trainer.precision={args.precision}",
                   f"trainer.num_threads={args.threads}", "model.embedding_dim=16", "trainer.enable_progress_bar=false",
                   f"topology={'1gpu' if args.device == 'cuda' else 'cpu'}", f"logger.tracking_uri=sqlite:///{tmp}/mlflow.db",
                   "logger.experiment_name=throughput", *args.extra]
    reference_cmd = [sys.executable, str(ROOT / "benchmarks" / "reference_deepfm.py"), str(store.root),
                     "--batch", str(args.batch), "--epochs", str(args.epochs), "--threads", str(args.threads),
                     "--precision", "bf16" if precision == "bf16-mixed" else "fp32"]
    baselines = {"plain PyTorch, one shared table (baseline)": ["--layout", "shared"],
                 "plain PyTorch, a table per field": ["--layout", "per_field"],
                 "MLP alone (dense-compute bound)": ["--mlp-only"],
                 "MLP alone + embedding input gradient": ["--mlp-only", "--input-grad"],
                 "the project's MLP layers alone + embedding input gradient": ["--mlp-only", "--input-grad",
                                                                              "--project-mlp"]}
    if args.skip_reference:
        baselines = {}
    variants = {name: overrides for name, overrides in VARIANTS.items()
                if any(name.endswith(v) for v in args.variants)}
    runs: dict[str, list[tuple[float, float, float | None]]] = {name: [] for name in [*variants, *baselines]}
    baseline = next(iter(baselines), None)
    for i in range(args.repeats):
        seed = args.seed + i  # one seed per round, the same for every run in it
        order = [("project", name) for name in variants] + [("reference", name) for name in baselines]
        if baseline is not None:  # the defaults and the baseline side by side, in turns first: drift cancels
            order.remove(("reference", baseline))
            order.insert(i % 2, ("reference", baseline))
        for kind, name in order:
            rival = competitor(data_overrides, work, env) if args.compete else None
            if kind == "project":
                run_dir = tmp / f"run{i}-{list(variants).index(name)}"
                _, rss = _run_measured([*project_cmd, *variants[name], f"seed={seed}", f"hydra.run.dir={run_dir}"], env,
                                       work)
                result = read_result(run_dir)
                runs[name].append((result.samples_per_s, rss, result.test_auc))
            else:
                out, rss = _run_measured([*reference_cmd, *baselines[name], "--seed", str(seed)], env, work)
                r = json.loads(out.strip().splitlines()[-1])
                runs[name].append((r["samples_per_s"], rss, r["test_auc"]))
            if rival is not None:
                rival.kill()
                rival.wait()
    print(f"\nDeepFM, {sum(store.meta['splits'].values()):,} rows ({store.meta['splits']['train']:,} train), "
          f"batch {args.batch}, {args.epochs} epoch(s), {args.threads} threads, precision {precision}"
          f"{', beside a competing training' if args.compete else ''}"
          f"{f', median of {args.repeats} alternating rounds' if args.repeats > 1 else ''}\n")
    print("| run | samples/s | peak RSS MiB | test AUC |")
    print("|---|---:|---:|---:|")
    for name, values in runs.items():
        aucs = [a for _, _, a in values if a is not None]
        auc = f"{statistics.median(aucs):.4f}" if aucs else "–"
        print(f"| {name} | {statistics.median(v[0] for v in values):,.0f} | "
              f"{statistics.median(v[1] for v in values):,.0f} | {auc} |")
    if baselines:
        shared, per_field, bound, grad_bound, own_bound = (runs[name] for name in baselines)
        print("\n| round (seed) | project | / shared-table baseline | / per-field baseline | / MLP bound "
              "| / MLP + input-gradient bound | / its own MLP layers' bound | test AUC: project / baseline |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for name in variants:
            for i, (p, s_, f_, b_, g_, o_) in enumerate(zip(runs[name], shared, per_field, bound, grad_bound, own_bound)):
                print(f"| {i + 1} ({args.seed + i}) | {name.split(', ', 1)[1]} | {p[0] / s_[0]:.2f}× | "
                      f"{p[0] / f_[0]:.2f}× | {p[0] / b_[0]:.2f}× | {p[0] / g_[0]:.2f}× | {p[0] / o_[0]:.2f}× | "
                      f"{p[2]:.4f} / {s_[2]:.4f} |")


if __name__ == "__main__":
    main()
