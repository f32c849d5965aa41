"""A SIGKILLed run does not stay RUNNING: its heartbeat stops, and the next run started against the store
marks it FAILED with the reason (no end time); a live run is left alone, also one whose clock is an hour
behind (staleness is judged on the watcher's clock alone); the killed run, resumed, is RUNNING again without
the failure note, and finishes FINISHED with an end time. Real processes and a real sqlite MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from mlflow.tracking import MlflowClient

from pipeline.config import LoggerConfig
from pipeline.tracking.heartbeat import FAILURE_TAG, HEARTBEAT_TAG, STALE_BEATS, mark_stale_runs
from pipeline.tracking.store import create_local_store, make_logger, start_logger
from tests.conftest import PYTHON, ROOT, subprocess_env

INTERVAL_S = 2.0  # the watch waits 5 beats (10 s): a loaded machine's beat is late by far less
CHILD = f"""
import sys, time
skew_s = float(sys.argv[2])
wall = time.time
time.time = lambda: wall() + skew_s  # this machine's clock, off by skew_s
from mlflow.tracking import MlflowClient
from pipeline.tracking import heartbeat
from pipeline.tracking.heartbeat import Heartbeat
if sys.argv[3] == "elsewhere":  # as if on another machine: only its beats tell whether it lives
    heartbeat.this_process = lambda: "another-host 0-0-0 12345 678"
client = MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name("beating") or client.create_experiment("beating")
run = client.create_run(getattr(experiment, "experiment_id", experiment)).info.run_id
Heartbeat(client, run, {INTERVAL_S}).start()  # as a run's logger starts it (the test's own run: through the logger)
print(run, flush=True)
time.sleep(600)
"""


def start_run(uri: str, skew_s: float = 0.0, where: str = "elsewhere") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PYTHON, "-c", CHILD, uri, str(skew_s), where], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    return proc, proc.stdout.readline().strip()


def stop_children(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def beat(client: MlflowClient, run_id: str) -> float:
    return float(client.get_run(run_id).data.tags[HEARTBEAT_TAG])


def wait_for_a_new_beat(client: MlflowClient, run_id: str) -> None:
    first, deadline = beat(client, run_id), time.time() + 60
    while beat(client, run_id) == first:  # the thread beats, not only the start
        assert time.time() < deadline, "no second heartbeat"
        time.sleep(0.2)


def test_a_killed_runs_stale_heartbeat_marks_it_failed_and_a_resume_reopens_it(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    create_local_store(uri)
    client = MlflowClient(uri)
    killed, killed_id = start_run(uri)
    behind, behind_id = start_run(uri, skew_s=-3600.0)  # alive, but stamps its beats an hour ago
    alive = make_logger(LoggerConfig(tracking_uri=uri, experiment_name="beating", heartbeat_s=INTERVAL_S))
    alive_id = alive.start()  # this process's run, beating from its thread
    try:
        assert killed_id and behind_id, "a child run did not start"
        wait_for_a_new_beat(client, killed_id)
        wait_for_a_new_beat(client, behind_id)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        last = beat(client, killed_id)
        assert client.get_run(killed_id).info.status == "RUNNING"

        started = time.monotonic()
        new = start_logger(LoggerConfig(tracking_uri=uri, experiment_name="another"), tmp_path, None, {})
        assert time.monotonic() - started < STALE_BEATS * INTERVAL_S, "the new run waited for the watch"
        printed, deadline = "", time.time() + 120
        while killed_id not in printed:  # the new run's watch marks it after 5 unchanged beats, and says so
            assert time.time() < deadline, f"the killed run was not marked: {printed}"
            time.sleep(0.5)
            printed += capsys.readouterr().out
        assert time.monotonic() - started >= STALE_BEATS * INTERVAL_S
        dead = client.get_run(killed_id)
        assert dead.info.status == "FAILED" and dead.info.end_time is None
        assert "no heartbeat for" in dead.data.tags[FAILURE_TAG] and beat(client, killed_id) == last
        for live in (alive_id, behind_id, new.run_id):
            assert client.get_run(live).info.status == "RUNNING" and live not in printed, printed
        assert mark_stale_runs(client, skip=new.run_id, overdue_only=True) == []  # (the behind one: it beats)

        resumed = make_logger(LoggerConfig(tracking_uri=uri, experiment_name="beating"), run_id=killed_id)
        resumed.start()
        again = client.get_run(killed_id)
        assert again.info.status == "RUNNING" and FAILURE_TAG not in again.data.tags and again.info.end_time is None
        assert beat(client, killed_id) > last
        assert all(logger.close(30, tmp_path) == [] for logger in (resumed, new, alive))
        ended = [client.get_run(r).info for r in (killed_id, new.run_id, alive_id)]
        assert {i.status for i in ended} == {"FINISHED"} and all(i.end_time for i in ended)
    finally:
        stop_children(killed, behind)


def test_a_run_killed_on_this_machine_is_marked_failed_by_the_next_short_run_before_it_ends(tmp_path, capsys):
    """The run recorded its host, boot id, pid and start time: a watcher on the same machine sees the process is gone
    and marks it at once, without waiting 5 beats (the next run here lasts ~2 s; 5 beats of 2 s take 10 s). A live
    run on this machine is left alone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    create_local_store(uri)
    client = MlflowClient(uri)
    killed, killed_id = start_run(uri, where="here")
    live, live_id = start_run(uri, where="here")
    try:
        assert killed_id and live_id
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert client.get_run(killed_id).info.status == "RUNNING"
        new = start_logger(LoggerConfig(tracking_uri=uri, experiment_name="another"), tmp_path, None, {})
        time.sleep(2)
        assert new.close(30, tmp_path) == []
        dead = client.get_run(killed_id)
        assert dead.info.status == "FAILED" and dead.info.end_time is None, dead.info
        assert f"its process (pid {killed.pid} on " in dead.data.tags[FAILURE_TAG], dead.data.tags[FAILURE_TAG]
        assert killed_id in capsys.readouterr().out
        assert client.get_run(live_id).info.status == "RUNNING"
    finally:
        stop_children(killed, live)
