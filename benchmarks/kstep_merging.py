"""k-step model merging vs. merging every step: AUC and bytes moved, 2 "nodes" × 2 processes.

    python benchmarks/kstep_merging.py --k 1 8 [--rows 1000000] [--extra model=dcn ...]

For each k, two ``torchrun`` agents on 127.0.0.1 (c10d rendezvous) stand in for two nodes of
two processes each and train DeepFM on the default synthetic data with
``trainer.merging.k=<k>``. The per-step bytes come from the collectives each rank actually
issued (``modules/comm_accounting.py``, logged to MLflow as ``comm/*_bytes_per_step``). Prints
test AUC, ΔAUC against the first k, merge bytes per step, their reduction, embedding all-to-all
bytes per step and samples/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))

from pipeline.runtime.launch import free_port  # noqa: E402
from pipeline.training.result import RunResult, read_result  # noqa: E402


def run_two_nodes(k: int, overrides: list[str], tracking_uri: str, nproc: int, out: Path) -> RunResult:
    """Train with two torchrun agents (node n's output folder ``out/node<n>``); rank 0's result."""
    port = free_port()

    def cmd(node: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=kstep-{k}-{port}",
                "-m", "pipeline.commands.train", f"trainer.merging.k={k}", "trainer.num_threads=1",
                "trainer.enable_progress_bar=false", f"logger.tracking_uri={tracking_uri}",
                "logger.experiment_name=kstep_merging", f"logger.run_name=k{k}", f"paths.cache_dir={out.parent / 'cache'}",
                *overrides,
                f"hydra.run.dir={out}/node{node}"]

    env = child_env({"OMP_NUM_THREADS": "1"}, {key: v for key, v in os.environ.items()
                                               if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")})
    out.mkdir(parents=True, exist_ok=True)
    agents = [subprocess.Popen(cmd(n), cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for n in range(2)]
    outputs = [a.communicate() for a in agents]
    for a, (_, err) in zip(agents, outputs):
        if a.returncode != 0:
            raise SystemExit(f"k={k}: torchrun agent failed (exit {a.returncode})\n{err[-3000:]}")
    found = [read_result(out / f"node{n}") for n in range(2) if (out / f"node{n}" / "result.json").is_file()]
    if len(found) != 1:
        raise SystemExit(f"k={k}: expected one result.json (global rank 0's), found {len(found)}")
    return found[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[1, 8])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: a temporary sqlite file)")
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides (e.g. data.synthetic.rows=...)")
    p.add_argument("--work", default=None, help="folder for the data and runs (default: a temporary one, removed)")
    args = p.parse_args()
    with work_folder(args.work, "bench-kstep-") as tmp:
        measure(args, tmp)


def measure(args: argparse.Namespace, tmp: Path) -> None:
    uri = args.tracking_uri or f"sqlite:///{tmp}/mlflow.db"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    rows = []
    for k in args.k:
        result = run_two_nodes(k, args.extra, uri, args.nproc_per_node, tmp / f"k{k}")
        auc, sps, run_id = result.test_auc, result.samples_per_s, result.mlflow_run_id
        metrics = client.get_run(run_id).data.metrics
        rows.append((k, auc, metrics.get("comm/merge_bytes_per_step", 0.0),
                     metrics.get("comm/embedding_bytes_per_step", 0.0), sps, run_id))
        print(f"k={k}: test AUC {auc:.4f}, run {run_id}", flush=True)
    k0, auc0, merge0 = rows[0][0], rows[0][1], rows[0][2]
    print(f"\n2 nodes x {args.nproc_per_node} processes, MLflow store {uri}\n")
    print(f"| k | test AUC | ΔAUC vs k={k0} | merge bytes/step | merge reduction | embedding bytes/step | samples/s |")
    print("|---|---|---|---|---|---|---|")
    for k, auc, merge, emb, sps, _ in rows:
        red = f"{merge0 / merge:.2f}×" if merge else "–"
        print(f"| {k} | {auc:.4f} | {auc - auc0:+.4f} | {merge:,.0f} | {red} | {emb:,.0f} | {sps:,.0f} |")


if __name__ == "__main__":
    main()
