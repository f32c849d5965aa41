"""Runs that died without a word: a heartbeat tag while a run lives, and FAILED for runs whose beat stopped,
judged on one clock.

A process killed by the OOM killer or ``kill -9`` never sets its MLflow run's final status: the run would
stay RUNNING forever. So, while a run lives, a thread of its logger sets two tags every
``logger.heartbeat_s`` seconds (directly, not through the delivery queue: a beat is worth nothing late):

    ctr.heartbeat     the beating machine's time of the last beat (Unix seconds; a new value each beat)
    ctr.heartbeat_s   the interval it promised

Staleness is never judged by comparing that time with another machine's clock (a skew of a few beats would
flip a live run FAILED and back). A watcher (:class:`StaleRunWatch`, :func:`mark_stale_runs`) reads the
tag of every RUNNING run, and marks FAILED only a run whose tag has not changed while ``STALE_BEATS`` of its
promised intervals passed on the watcher's own monotonic clock:

    stale(run)  <=>  beat(t0) == beat(t0 + STALE_BEATS * interval)     (t0, t: the watcher's clock)

The next run started against the same store watches from a thread of its own (it is not held up); ``ctr
sync`` watches the target's runs whose last beat also *looks* overdue by the wall clock, and waits for them.
A run also records where it runs (``ctr.process``: host, boot id, pid and the process's start time). A watcher on
the same machine (same host name and boot id) needs no beats: if that process is gone (or the pid now belongs to a
process started at another time), the run is marked FAILED at once — a run killed and followed by a short one is
marked before that one ends. On other machines the rule above stands.
A marked run gets ``ctr.failure`` (why) and status FAILED but no end time (MLflow cannot clear one again);
a run resumed later (same run id) is set RUNNING again and ``ctr.failure`` removed (:func:`reopen`), and so
is a live run that was cut from the store for longer than that (its next beat finds the mark). Runs
without the tags (other tools', older ones) are never touched.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from datetime import datetime, timezone

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

HEARTBEAT_TAG = "ctr.heartbeat"
INTERVAL_TAG = "ctr.heartbeat_s"
FAILURE_TAG = "ctr.failure"
PROCESS_TAG = "ctr.process"
STALE_BEATS = 5  # a run missing this many beats in a row is taken for dead


def _machine() -> str:
    """This machine while it runs: its host name and the kernel's boot id (a reboot reuses pids)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()} {boot.read_text().strip() if boot.exists() else '-'}"


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the fields after the command name, which may hold spaces


def this_process() -> str:
    """``ctr.process`` of this process: ``<host> <boot id> <pid> <start time>``."""
    return f"{_machine()} {os.getpid()} {_started(os.getpid()) or '-'}"


def gone_here(process: str) -> bool:
    """Whether the process a ``ctr.process`` tag names ran on this machine and is no longer there."""
    parts = process.split()
    if len(parts) != 4 or " ".join(parts[:2]) != _machine() or not parts[2].isdigit():
        return False  # another machine (or boot): only its beats can tell
    return _started(int(parts[2])) != parts[3]


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def reopen(client: MlflowClient, run_id: str) -> None:
    """A resumed run (or one wrongly marked dead) is RUNNING again, without the failure note."""
    run = client.get_run(run_id)
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    if FAILURE_TAG in run.data.tags:
        client.delete_tag(run_id, FAILURE_TAG)


class _Background:
    """``self._run`` on a daemon thread of its own (named ``name``), from :meth:`start` until :meth:`stop` sets
    ``self._stop``."""

    name = ""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)  # a store call in flight ends within the client's request timeout


class Heartbeat(_Background):
    """Beats for ``run_id`` every ``interval_s`` from a daemon thread until :meth:`stop` (a failed beat —
    the store unreachable — is retried at the next one)."""

    name = "mlflow-heartbeat"

    def __init__(self, client: MlflowClient, run_id: str, interval_s: float) -> None:
        super().__init__()
        self.client, self.run_id, self.interval_s = client, run_id, interval_s

    def start(self) -> "Heartbeat":
        try:
            self.client.set_tag(self.run_id, PROCESS_TAG, this_process())
            self.beat()
        except Exception:  # noqa: BLE001 — the store is away: the thread beats when it is back
            pass
        return super().start()

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


@dataclass(frozen=True)
class _Seen:
    """A RUNNING run's beat as a watcher first read it, at ``at`` on the watcher's monotonic clock."""
    name: str
    beat: str
    interval_s: float
    at: float
    process: str = ""  # (its ctr.process tag)

    @property
    def due(self) -> float:
        return self.at + STALE_BEATS * self.interval_s


def _beating_runs(client: MlflowClient, skip: str | None, overdue_only: bool) -> dict[str, _Seen]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return {}
    seen, now = {}, time.monotonic()
    for run in client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'", max_results=5000):
        tags = run.data.tags
        if run.info.run_id == skip or HEARTBEAT_TAG not in tags:
            continue
        try:
            last, interval = float(tags[HEARTBEAT_TAG]), float(tags.get(INTERVAL_TAG, "nan"))
        except ValueError:
            continue
        process = tags.get(PROCESS_TAG, "")
        if not gone_here(process) and (not interval > 0 or (overdue_only and not time.time() - last > STALE_BEATS
                                                             * interval)):
            continue  # (a NaN interval: never stale)
        seen[run.info.run_id] = _Seen(run.info.run_name, tags[HEARTBEAT_TAG], interval, now, process)
    return seen


def _mark(client: MlflowClient, run_id: str, seen: _Seen, waited_s: float | None) -> str | None:
    """``waited_s`` None: its process is gone from this machine."""
    last = float(seen.beat)
    if waited_s is None:
        host, _, pid, _ = seen.process.split()
        reason = (f"its process (pid {pid} on {host}, this machine) is gone, its last beat stamped {_when(last)}: "
                  f"it was killed (OOM killer, kill -9); marked FAILED. Resuming it (trainer.resume) sets it "
                  f"RUNNING again.")
    else:
        reason = (f"no heartbeat for {waited_s:,.0f} s ({STALE_BEATS} of the {seen.interval_s:g} s beats it promised; "
                  f"its last beat is stamped {_when(last)} by its own clock): the process was killed (OOM killer, "
                  f"kill -9, a lost node) or lost the store; marked FAILED. Resuming it (trainer.resume) sets it "
                  f"RUNNING again.")
    try:
        client.set_tag(run_id, FAILURE_TAG, reason)
        client.update_run(run_id, status="FAILED")  # no end time: a resume could not clear it
    except MlflowException:
        return None
    return f"MLflow run {run_id} ({seen.name}): {reason}"


def mark_stale_runs(client: MlflowClient, skip: str | None = None, overdue_only: bool = False,
                    stop: threading.Event | None = None, say=None) -> list[str]:
    """Watch the store's RUNNING runs that beat (not ``skip``, the caller's own) and mark FAILED at once each whose
    process is gone from this machine, and each whose beat stays the same for ``STALE_BEATS`` of its intervals on
    this process's clock; returns (and passes to
    ``say``, as they come) lines saying which. ``overdue_only``: watch only runs whose last beat also looks
    overdue by the wall clock (nothing to wait for when every run beats). Returns early when ``stop`` is set."""
    stop = stop or threading.Event()
    watched, lines = _beating_runs(client, skip, overdue_only), []

    def mark(run_id: str, waited_s: float | None) -> None:
        line = _mark(client, run_id, watched.pop(run_id), waited_s)
        if line is not None:
            lines.append(line)
            if say is not None:
                say(line)
    for run_id in [r for r, seen in watched.items() if gone_here(seen.process)]:  # no beat to wait for
        mark(run_id, None)
    if overdue_only and say is not None and watched:
        say(f"{len(watched)} RUNNING run(s) look overdue by the wall clock; watching their heartbeat for up to "
            f"{max(s.due for s in watched.values()) - time.monotonic():,.0f} s")
    while watched and not stop.is_set():
        stop.wait(max(0.0, min(min(s.interval_s for s in watched.values()),
                               min(s.due for s in watched.values()) - time.monotonic())))
        if stop.is_set():
            break
        for run_id, seen in list(watched.items()):
            try:
                run = client.get_run(run_id)
            except MlflowException:
                continue  # (deleted, or the store away: tried at the next look)
            if run.info.status != "RUNNING" or run.data.tags.get(HEARTBEAT_TAG) != seen.beat:
                del watched[run_id]  # it ended, or beat: alive
            elif time.monotonic() >= seen.due:
                mark(run_id, time.monotonic() - seen.at)
    return lines


class StaleRunWatch(_Background):
    """:func:`mark_stale_runs` from a daemon thread (a starting run is not held up), printing what it marks;
    :meth:`stop` ends it (a run that ends first leaves the marking to the next)."""

    name = "mlflow-stale-runs"

    def __init__(self, client: MlflowClient, skip: str | None) -> None:
        super().__init__()
        self.client, self.skip = client, skip

    def _run(self) -> None:
        try:
            mark_stale_runs(self.client, skip=self.skip, stop=self._stop, say=lambda line: print(line, flush=True))
        except Exception as e:  # noqa: BLE001 — looking for dead runs never stops this one
            print(f"MLflow: could not look for runs whose heartbeat stopped: {e}", flush=True)
