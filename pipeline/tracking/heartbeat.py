"""Runs that died without a word: a heartbeat tag while a run lives, and FAILED for runs whose beat stopped.

A process killed by the OOM killer or ``kill -9`` never sets its MLflow run's final status: the run would
stay RUNNING forever. So, while a run lives, a thread of its logger sets two tags every
``logger.heartbeat_s`` seconds (directly, not through the delivery queue: a beat is worth nothing late):

    ctr.heartbeat     the time of the last beat (Unix seconds)
    ctr.heartbeat_s   the interval it promised

A run is *stale* when it is RUNNING and its last beat is older than ``STALE_BEATS`` intervals. The next
run that starts against the same store, and ``ctr sync`` on its target, mark stale runs FAILED with the
tag ``ctr.failure`` saying why (:func:`mark_stale_runs`). A run resumed later (same run id) is set
RUNNING again and its ``ctr.failure`` removed (:func:`reopen`); so is a live run that was cut from the
store for longer than that (its next beat finds the mark and takes it back). Runs without the tags
(other tools', older ones) are never touched.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

HEARTBEAT_TAG = "ctr.heartbeat"
INTERVAL_TAG = "ctr.heartbeat_s"
FAILURE_TAG = "ctr.failure"
STALE_BEATS = 5  # a run missing this many beats in a row is taken for dead


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def reopen(client: MlflowClient, run_id: str) -> None:
    """A resumed run (or one wrongly marked dead) is RUNNING again, without the failure note."""
    run = client.get_run(run_id)
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    if FAILURE_TAG in run.data.tags:
        client.delete_tag(run_id, FAILURE_TAG)


class Heartbeat:
    """Beats for ``run_id`` every ``interval_s`` from a daemon thread until :meth:`stop` (a failed beat —
    the store unreachable — is retried at the next one)."""

    def __init__(self, client: MlflowClient, run_id: str, interval_s: float) -> None:
        self.client, self.run_id, self.interval_s = client, run_id, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        try:
            self.beat()
        except Exception:  # noqa: BLE001 — the store is away: the thread beats when it is back
            pass
        self._thread.start()
        return self

    def beat(self) -> None:
        self.client.set_tag(self.run_id, INTERVAL_TAG, f"{self.interval_s:g}")
        self.client.set_tag(self.run_id, HEARTBEAT_TAG, f"{time.time():.3f}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                if FAILURE_TAG in self.client.get_run(self.run_id).data.tags:  # marked dead while cut off
                    reopen(self.client, self.run_id)
            except Exception:  # noqa: BLE001 — the store is away: the next beat tries again
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)  # a beat in flight ends within the client's request timeout


def mark_stale_runs(client: MlflowClient, now: float | None = None, skip: str | None = None) -> list[str]:
    """Mark every RUNNING run of the store whose heartbeat stopped FAILED (see module doc); returns lines
    saying which. ``skip``: a run id never to mark (the caller's own)."""
    now = time.time() if now is None else now
    lines = []
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return lines
    for run in client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'", max_results=5000):
        tags = run.data.tags
        if run.info.run_id == skip or HEARTBEAT_TAG not in tags:
            continue
        try:
            last, interval = float(tags[HEARTBEAT_TAG]), float(tags.get(INTERVAL_TAG, "nan"))
        except ValueError:
            continue
        if not now - last > STALE_BEATS * interval:  # (a NaN interval: never stale)
            continue
        reason = (f"no heartbeat since {_when(last)} ({now - last:,.0f} s; it promised one every {interval:g} s): "
                  f"the process was killed (OOM killer, kill -9, a lost node) or lost the store; marked FAILED at "
                  f"{_when(now)}. Resuming it (trainer.resume) sets it RUNNING again.")
        try:
            client.set_tag(run.info.run_id, FAILURE_TAG, reason)
            client.set_terminated(run.info.run_id, "FAILED", end_time=int(last * 1000))
        except MlflowException:
            continue
        lines.append(f"MLflow run {run.info.run_id} ({run.info.run_name}): {reason}")
    return lines
