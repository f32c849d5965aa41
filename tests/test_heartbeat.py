"""A SIGKILLed run does not stay RUNNING: its heartbeat stops, and the next run started against the store
marks it FAILED with the reason; a live run is left alone; the killed run, resumed, is RUNNING again
without the failure note, and finishes FINISHED. Real processes and a real sqlite MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from mlflow.tracking import MlflowClient

from pipeline.config import LoggerConfig
from pipeline.tracking.heartbeat import FAILURE_TAG, HEARTBEAT_TAG, STALE_BEATS
from pipeline.tracking.store import create_local_store, make_logger, start_logger
from tests.conftest import PYTHON, ROOT, subprocess_env

INTERVAL_S = 1.0
CHILD = f"""
import sys, time
from mlflow.tracking import MlflowClient
from pipeline.tracking.heartbeat import Heartbeat
client = MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name("beating") or client.create_experiment("beating")
run = client.create_run(getattr(experiment, "experiment_id", experiment)).info.run_id
Heartbeat(client, run, {INTERVAL_S}).start()  # as a run's logger starts it (the test's own run: through the logger)
print(run, flush=True)
time.sleep(600)
"""


def start_run(uri: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PYTHON, "-c", CHILD, uri], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, proc.stdout.readline().strip()


def beat(client: MlflowClient, run_id: str) -> float:
    return float(client.get_run(run_id).data.tags[HEARTBEAT_TAG])


def test_a_killed_runs_stale_heartbeat_marks_it_failed_and_a_resume_reopens_it(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    create_local_store(uri)
    client = MlflowClient(uri)
    killed, killed_id = start_run(uri)
    alive = make_logger(LoggerConfig(tracking_uri=uri, experiment_name="beating", heartbeat_s=INTERVAL_S))
    alive_id = alive.start()  # this process's run, beating from its thread
    try:
        assert killed_id, "the child run did not start"
        first, deadline = beat(client, killed_id), time.time() + 60
        while beat(client, killed_id) == first:  # the thread beats, not only the start
            assert time.time() < deadline, "no second heartbeat"
            time.sleep(0.2)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        last = beat(client, killed_id)
        assert client.get_run(killed_id).info.status == "RUNNING"
        while time.time() < last + STALE_BEATS * INTERVAL_S + 0.5:
            time.sleep(0.2)

        new = start_logger(LoggerConfig(tracking_uri=uri, experiment_name="another"), tmp_path, None, {})
        printed = capsys.readouterr().out
        dead = client.get_run(killed_id)
        assert dead.info.status == "FAILED" and dead.info.end_time == int(last * 1000)
        assert "no heartbeat since" in dead.data.tags[FAILURE_TAG] and killed_id in printed, printed
        assert client.get_run(alive_id).info.status == "RUNNING" and alive_id not in printed
        assert client.get_run(new.run_id).info.status == "RUNNING"

        resumed = make_logger(LoggerConfig(tracking_uri=uri, experiment_name="beating"), run_id=killed_id)
        resumed.start()
        again = client.get_run(killed_id)
        assert again.info.status == "RUNNING" and FAILURE_TAG not in again.data.tags
        assert beat(client, killed_id) > last
        assert all(logger.close(30, tmp_path) == [] for logger in (resumed, new, alive))
        assert {client.get_run(r).info.status for r in (killed_id, new.run_id, alive_id)} == {"FINISHED"}
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        killed.stdout.close()
