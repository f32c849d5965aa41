"""Training across a shaped link: wall time, bytes and AUC of each recipe on a cluster of namespaces.

    python benchmarks/cluster_training.py --rate-mbit 100 [--nodes 2 --nproc 1 --rows 1000000] \\
        [--recipes one_node ddp auto k8 half k8_half ...] [--extra model.mlp=[400,400,400] ...]

Each recipe trains DeepFM on the synthetic log (global batch 4,096, one epoch, one thread a process,
validation four times an epoch) on ``--nodes`` network namespaces whose links are shaped to ``--rate-mbit``
both ways (benchmarks/netns_cluster.py), one torchrun agent per node; ``one_node`` is the baseline of one
process with one thread and no network. Recipes (Hydra overrides):

    ddp      trainer.merging.k=null, every collective fp32 (what a user runs today)
    auto     the defaults with the link stated: topology.bandwidth_gbps.inter_node=<rate in GB/s>
    k<K>     trainer.merging.k=K, fp32 comms;  k<K>m: also Adam's moments merged
    half     DDP with fp16 pooled embeddings both ways, fp16 dense all-reduce
    k<K>_half  both;  k<K>_int8: int8 pooled embeddings forward (a scale and bias a row), fp16 backward
    rep<K>   every table whole on every rank, its looked-up rows merged with the dense part every K steps
             (trainer.merging.tables=replicated: no embedding all-to-all);  rep<K>_half: the updates in fp16
    node<K>  every table on every node, sharded over its ranks (all-to-all and DDP inside the node), the nodes'
             copies merged every K steps (trainer.merging.tables=per_node);  node<K>_half: the updates in fp16
    <k, rep or node recipe>_ov[J]   each merge travelling during the next K (or J) steps (trainer.merging.overlap=K|J)
    <recipe>_loopback   the same processes and settings over 127.0.0.1, no namespaces and no shaping: what the
             link itself costs (auto_loopback states the same link, so it makes the same choices)

Prints per recipe: training samples/s, the job's wall time, bytes per step and rank counted from the
collectives, bytes that left node 0's interface per training step, the link's share of a step
(those bytes at the rate, over the measured step time), test AUC, and the wall time at which validation
first reached ddp's best validation AUC − 0.001 (the time-to-AUC target; "–" if never); then, for ``auto``, its wall
time and time to target against ``auto_loopback``, ``ddp`` and ``one_node`` where they ran. Logs a plot of validation
AUC against wall time per recipe to MLflow (experiment ``cluster_training``, a run ``summary``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))

from benchmarks.netns_cluster import Cluster, wait_all  # noqa: E402
from pipeline.runtime.launch import free_port  # noqa: E402
from pipeline.training.result import read_result  # noqa: E402

# fp16 both ways: on CPU TorchRec sends bf16 as fp16 (the runs of 2026-11-28 asked for a bf16 backward and got fp16)
HALF = ["trainer.comms.embedding_forward=fp16", "trainer.comms.embedding_backward=fp16", "trainer.comms.dense=fp16"]
FP32 = ["trainer.comms.embedding_forward=fp32", "trainer.comms.embedding_backward=fp32", "trainer.comms.dense=fp32"]
LOOPBACK = "_loopback"


def recipe_overrides(name: str, rate_mbit: float) -> list[str]:
    if name.endswith(LOOPBACK):
        return recipe_overrides(name[:-len(LOOPBACK)], rate_mbit)
    base, ov, late = name.partition("_ov")
    if ov:  # _ov: land each merge when the next leaves (k steps late); _ov<J>: J steps late
        k = int("".join(ch for ch in base.split("_")[0] if ch.isdigit()))
        return [*recipe_overrides(base, rate_mbit)[:-1], f"trainer.merging.overlap={int(late or k)}"]
    if name.startswith(("rep", "node", "k")):
        return [*_recipe(name, rate_mbit), "trainer.merging.overlap=0"]
    return _recipe(name, rate_mbit)


def _recipe(name: str, rate_mbit: float) -> list[str]:
    if name in ("ddp", "one_node"):
        return ["trainer.merging.k=null", *FP32]
    if name == "auto":
        return [f"topology.bandwidth_gbps.inter_node={rate_mbit / 8000:g}"]
    if name == "half":
        return ["trainer.merging.k=null", "trainer.merging.tables=sharded", *HALF]
    if name.startswith(("rep", "node")):
        tables = "replicated" if name.startswith("rep") else "per_node"
        k, _, updates = name.lstrip("repnod").partition("_")
        return [f"trainer.merging.k={int(k)}", f"trainer.merging.tables={tables}", *FP32[:1],
                f"trainer.comms.embedding_backward={'fp16' if updates == 'half' else 'fp32'}", FP32[2]]
    if name.startswith("k"):  # sharded tables, as before replicated ones were weighed
        k, _, comms = name[1:].partition("_")
        moments = k.endswith("m")
        precision = {"": FP32, "half": HALF[:2], "int8": ["trainer.comms.embedding_forward=int8", HALF[1]]}[comms]
        return [f"trainer.merging.k={int(k.rstrip('m'))}", f"trainer.merging.moments={str(moments).lower()}",
                "trainer.merging.tables=sharded",
                *precision[:2], "trainer.comms.dense=fp32"]
    raise SystemExit(f"unknown recipe {name!r}: expected one_node, ddp, auto, half, k<K>[m][_half|_int8], "
                     f"rep<K>[_half], node<K>[_half]")


def env() -> dict[str, str]:
    out = child_env({"OMP_NUM_THREADS": "1"}, {k: v for k, v in os.environ.items()
                                               if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")})
    return out


def run(name: str, args, common: list[str], out: Path) -> dict:
    job = [*common, *recipe_overrides(name, args.rate_mbit), *args.extra, f"logger.run_name={name}"]
    folder = out / name
    folder.mkdir(parents=True)
    start = time.monotonic()
    if name == "one_node":
        with open(folder / "node0.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "pipeline.commands.train", *job,
                                   f"hydra.run.dir={folder}/node0"], cwd=out, env=env(), stdout=log,
                                  stderr=subprocess.STDOUT)
        codes, sent = [proc.returncode], None
    elif name.endswith(LOOPBACK):
        port = free_port()
        agents = []
        for n in range(args.nodes):
            with open(folder / f"node{n}.log", "w") as log:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nodes}",
                     f"--nproc_per_node={args.nproc}", f"--max-restarts={args.max_restarts}",
                     "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                     f"--rdzv_id={name}{port}", "-m", "pipeline.commands.train", *job, f"hydra.run.dir={folder}/node{n}"],
                    cwd=out, env=env(), stdout=log, stderr=subprocess.STDOUT))
        codes, sent = wait_all(agents, args.timeout_s), None
    else:
        with Cluster(nodes=args.nodes, rate_mbit=args.rate_mbit) as cluster:
            agents = []
            for n in range(args.nodes):
                with open(folder / f"node{n}.log", "w") as log:
                    agents.append(cluster.torchrun(n, args.nproc, name, ["-m", "pipeline.commands.train", *job,
                                                   f"hydra.run.dir={folder}/node{n}"], env(), cwd=out, stdout=log,
                                                   max_restarts=args.max_restarts,
                                                   stderr=subprocess.STDOUT))
            codes = wait_all(agents, args.timeout_s)
            sent = cluster.tx_bytes(0)
    wall = time.monotonic() - start
    if any(c != 0 for c in codes):
        tail = "".join(f"\n--- {log.name}:\n" + log.read_text()[-2000:] for log in sorted(folder.glob("node*.log")))
        raise SystemExit(f"{name}: exit codes {codes}{tail}")
    result = read_result(folder / "node0")
    return {"name": name, "wall_s": wall, "result": result, "node0_tx": sent}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate-mbit", type=float, default=100)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="processes per node")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--recipes", nargs="+", default=["one_node", "ddp", "auto", "k8", "half"])
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every recipe")
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun's, for each agent: with "
                   "--extra trainer.checkpoint.dir=... trainer.resume=auto, a killed worker's job resumes")
    p.add_argument("--target-auc", type=float, help="the time-to-AUC target, from an earlier run of ddp on the same "
                   "data (DDP is deterministic here): ddp need not run again")
    p.add_argument("--work", default=None, help="folder for the data and runs (default: a temporary one, removed)")
    args = p.parse_args()
    if "ddp" not in args.recipes and args.target_auc is None:
        raise SystemExit("--recipes must include ddp (the AUC target), or give --target-auc")
    with work_folder(args.work, "bench-cluster-") as out:
        measure(args, out)


def measure(args: argparse.Namespace, out: Path) -> None:
    uri = f"sqlite:///{out}/mlflow.db"
    common = [f"data.synthetic.rows={args.rows}", f"paths.cache_dir={out / 'cache'}", f"trainer.batch_size={args.batch}", "trainer.max_epochs=1",
              "trainer.num_threads=1", "trainer.enable_progress_bar=false", "trainer.val_check_interval=0.25",
              "logger.log_model=false", f"logger.tracking_uri={uri}", "logger.experiment_name=cluster_training"]
    rows = []
    for name in args.recipes:
        rows.append(run(name, args, common, out))
        r = rows[-1]["result"]
        print(f"{name}: {rows[-1]['wall_s']:.0f} s, test AUC {r.test_auc:.4f}, {r.samples_per_s:,.0f} samples/s",
              flush=True)
    report(rows, args, uri)


def report(rows: list[dict], args, uri: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    ddp = next((r["result"] for r in rows if r["name"] == "ddp"), None)
    target = args.target_auc if ddp is None else \
        max(m.value for m in client.get_metric_history(ddp.mlflow_run_id, "val/auc")) - 0.001
    steps = args.rows * 0.85 // args.batch
    reached_at: dict[str, float | None] = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    print(f"\n{args.nodes} nodes × {args.nproc} process(es) at {args.rate_mbit:g} Mbit/s; {args.rows:,} rows, "
          f"batch {args.batch:,}; target: ddp's best validation AUC − 0.001 = {target:.4f}; store {uri}\n")
    print("| recipe | samples/s | wall s | counted bytes/step/rank | node 0 link bytes/step | link share of step "
          "| test AUC | s to target |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = row["result"]
        run = client.get_run(r.mlflow_run_id)
        history = sorted(client.get_metric_history(r.mlflow_run_id, "val/auc"), key=lambda m: m.timestamp)
        t0 = run.info.start_time
        times = [(m.timestamp - t0) / 1e3 for m in history]
        ax.plot(times, [m.value for m in history], marker="o", label=row["name"])
        reached = reached_at[row["name"]] = next((t for t, m in zip(times, history) if m.value >= target), None)
        link = row["node0_tx"] / steps if row["node0_tx"] else 0.0
        step_s = args.batch / r.samples_per_s
        share = f"{link * 8 / (args.rate_mbit * 1e6) / step_s:.0%}" if link else "–"
        print(f"| {row['name']} | {r.samples_per_s:,.0f} | {row['wall_s']:.0f} | {r.comm_bytes_per_step:,.0f} | "
              f"{link:,.0f} | {share} | {r.test_auc:.4f} | {f'{reached:.0f}' if reached else '–'} |")
    ratios(rows, reached_at)
    ax.axhline(target, color="grey", linestyle=":", label="ddp's best − 0.001")
    ax.set_xlabel("wall time since the run started (s)")
    ax.set_ylabel("validation AUC")
    ax.set_title(f"{args.nodes}×{args.nproc} at {args.rate_mbit:g} Mbit/s")
    ax.legend()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("cluster_training")
    with mlflow.start_run(run_name="summary"):
        mlflow.log_params({"rate_mbit": args.rate_mbit, "nodes": args.nodes, "nproc": args.nproc, "rows": args.rows})
        mlflow.log_figure(fig, "val_auc_vs_wall_time.png")
    print(f"\nplot: val_auc_vs_wall_time.png in the run 'summary' of experiment cluster_training ({uri})")


def ratios(rows: list[dict], reached_at: dict[str, float | None]) -> None:
    """The default (``auto``) against the same processes over loopback, DDP over the same link, and one node."""
    by_name = {r["name"]: r for r in rows}
    if "auto" not in by_name:
        return
    auto = by_name["auto"]
    print("\n| auto against | wall | time to target |\n|---|---:|---:|")
    for other in ("auto" + LOOPBACK, "ddp", "one_node"):
        if other in by_name:
            wall = auto["wall_s"] / by_name[other]["wall_s"]
            a, b = reached_at.get("auto"), reached_at.get(other)
            print(f"| {other} | {wall:.3f}× | {f'{a / b:.3f}×' if a and b else '–'} |")


if __name__ == "__main__":
    main()
