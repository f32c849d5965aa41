"""Soak: runs sharing one data cache and one MLflow store, hit by random SIGTERMs, restarted with resume=auto.

    python benchmarks/soak.py --minutes 7 --jobs 3          # job 3 (every third) under torchrun with 2 ranks

For a bounded time, ``--jobs`` training runs (the synthetic log, one shared cache folder and one fresh
``sqlite:///`` store; a checkpoint every 25 steps) run at once. At random moments (each running job, every
second, with probability ``--kill-rate``, once it has run ``--min-age`` seconds) a job gets SIGTERM (under
torchrun: the launcher, which passes it to its ranks); a job that exits non-zero is started again with
``trainer.resume=auto`` and goes on until it finishes. At the end the script checks what was kept:

* every finished job has one MLflow run, FINISHED, continued across its restarts, with ``val/auc`` for
  every epoch and ``test/auc`` — anything absent counts as a missing metric (expected 0);
* every checkpoint left matches its manifest, and every store in the cache opens (expected 0 corrupt);
* the longest time from a SIGTERM to the process's exit.

Nothing here runs in CI (it takes minutes); its last table is in docs/failure_behaviour.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from work_folder import ROOT, child_env  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))


@dataclass
class Job:
    name: str
    ranks: int
    proc: subprocess.Popen | None = None
    started: float = 0.0
    attempts: int = 0
    signalled_at: float | None = None
    done: bool = False
    exits: list[int] = field(default_factory=list)


def start(job: Job, work: Path, epochs: int) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={job.ranks}"] \
        if job.ranks > 1 else [sys.executable]
    args = [f"paths.cache_dir={work / 'cache'}", "data.synthetic.rows=200000", "trainer.batch_size=2048",
            f"trainer.max_epochs={epochs}", "model.mlp=[64,32]", "trainer.enable_progress_bar=false",
            f"logger.tracking_uri=sqlite:///{work / 'mlflow.db'}", f"logger.run_name={job.name}",
            "logger.log_model=false", f"trainer.checkpoint.dir={work / job.name / 'ckpt'}",
            "trainer.checkpoint.every_n_steps=25", "trainer.resume=auto",
            f"hydra.run.dir={work / job.name / f'attempt{job.attempts}'}"]
    log = open(work / job.name / f"attempt{job.attempts}.log", "w")
    job.proc = subprocess.Popen([*launcher, "-m", "pipeline.commands.train", *args], cwd=work, stdout=log,
                                stderr=subprocess.STDOUT, env=child_env({"OMP_NUM_THREADS": "1"}))
    log.close()
    job.started, job.signalled_at = time.monotonic(), None
    job.attempts += 1


def check(work: Path, jobs: list[Job], epochs: int) -> tuple[int, int, int]:
    """(metrics missing from MLflow, runs left neither FINISHED nor KILLED, corrupt checkpoints or stores)."""
    from mlflow.tracking import MlflowClient

    from pipeline.checkpoint.discovery import complete_checkpoints
    from pipeline.checkpoint.manifest import verify_checkpoint
    from pipeline.data.store import ColumnarStore

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    missing = 0
    unclosed = sum(r.info.status not in ("FINISHED", "KILLED") for r in runs)
    for job in jobs:
        finished = [r for r in runs if r.info.run_name == job.name and r.info.status == "FINISHED"]
        if not job.done or len(finished) != 1:
            missing += 1  # a job without exactly one finished run (one stopped before its first checkpoint
            continue      # starts a new run: the stopped one stays KILLED)
        run = finished[0]
        val_epochs = {m.step for m in client.get_metric_history(run.info.run_id, "val/auc")}
        missing += max(0, epochs - len(val_epochs)) + ("test/auc" not in run.data.metrics)
    corrupt = sum(bool(verify_checkpoint(c)) for job in jobs for c in complete_checkpoints(work / job.name / "ckpt"))
    for store in (work / "cache" / "stores").glob("*"):
        if store.is_dir() and ".tmp" not in store.name:
            try:
                ColumnarStore(store)
            except (OSError, ValueError):
                corrupt += 1
    return missing, unclosed, corrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--kill-rate", type=float, default=0.08, help="chance per second that a running job gets SIGTERM")
    p.add_argument("--min-age", type=float, default=15.0, help="seconds a job runs before it may be signalled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=".cache/soak", help="folder for the jobs (default: under the current folder; "
                   "emptied at the start, kept at the end for a look)")
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    rng = random.Random(args.seed)
    jobs = [Job(f"job{i}", 2 if i % 3 == 2 else 1) for i in range(args.jobs)]
    for job in jobs:
        (work / job.name).mkdir(parents=True)
        start(job, work, args.epochs)
    deadline, exit_times, signals = time.monotonic() + 60 * args.minutes, [], 0
    while time.monotonic() < deadline and not all(j.done for j in jobs):
        time.sleep(1.0)
        for job in jobs:
            if job.done or job.proc is None:
                continue
            code = job.proc.poll()
            if code is not None:
                job.exits.append(code)
                if job.signalled_at is not None:
                    exit_times.append(time.monotonic() - job.signalled_at)
                if code == 0:
                    job.done = True
                else:
                    start(job, work, args.epochs)
            elif job.signalled_at is None and time.monotonic() - job.started > args.min_age \
                    and rng.random() < args.kill_rate:
                job.proc.send_signal(signal.SIGTERM)
                job.signalled_at, signals = time.monotonic(), signals + 1
    for job in jobs:  # bounded: whatever still runs is stopped (and counted as unfinished)
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
    missing, unclosed, corrupt = check(work, jobs, args.epochs)
    print("\n| jobs (2-rank) | runs started | finished | SIGTERMs | restarts | metrics missing | MLflow runs not "
          "closed | corrupt files | longest signal → exit |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(jobs)} ({sum(j.ranks > 1 for j in jobs)}) | {sum(j.attempts for j in jobs)} "
          f"| {sum(j.done for j in jobs)} | {signals} | {sum(j.attempts - 1 for j in jobs)} | {missing} | {unclosed} "
          f"| {corrupt} | {max(exit_times, default=0):.1f} s |")
    print("exit codes per job: " + "; ".join(f"{j.name}: {j.exits}" for j in jobs))


if __name__ == "__main__":
    main()
