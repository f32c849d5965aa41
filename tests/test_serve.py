"""``ctr serve`` as a real server on 127.0.0.1 (2 worker processes): every request format answers what
``ctr predict`` writes for the same rows, bad requests get a 400 naming the column or field and never
kill a worker, ``/metrics`` counts what was sent, and a new version published under load is swapped in
with no request lost and no answer mixing versions (float32 → int8, each checked against predict)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.conftest import PYTHON, ROOT, free_port, subprocess_env


def predicted(model: Path, rows: pd.DataFrame, folder: Path) -> np.ndarray:
    """``ctr predict``'s probabilities of ``rows`` (its function, in this process)."""
    from pipeline.serving.prediction import PredictArgs, run

    rows.to_csv(folder / "rows.csv", index=False)
    run(PredictArgs(checkpoint=str(model), input=str(folder / "rows.csv"), output=str(folder / "rows.parquet")))
    return pd.read_parquet(folder / "rows.parquet")["probability"].to_numpy()


class Server:
    def __init__(self, workdir: Path, *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([PYTHON, "-m", "pipeline.commands.serve", *args, f"serve.port={self.port}",
                                      f"serve.dir={workdir}"], cwd=ROOT, env=subprocess_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.time() + 180
        while True:
            try:
                if self.get("/ping")[0] == 200:
                    break
            except OSError:
                assert self.proc.poll() is None and time.time() < deadline, self.proc.stderr.read().decode()[-3000:]
                time.sleep(0.5)

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.status, r.read()

    def post(self, body: bytes, content_type: str = "application/json") -> tuple[int, dict, str | None]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/invocations", data=body,
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read()), r.headers.get("X-Model-Version")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.proc.stderr.close()


def probabilities(answer: dict) -> np.ndarray:
    return np.array([p["probability"] for p in answer["predictions"]])


def split_body(frame: pd.DataFrame) -> bytes:
    return json.dumps({"dataframe_split": json.loads(frame.to_json(orient="split", index=False))}).encode()


@pytest.fixture(scope="module")
def served_rows(own_data_run, tmp_path_factory):
    folder, _, _, _, frame, _ = own_data_run
    rows = frame.drop(columns=["clicked"]).iloc[:40].reset_index(drop=True)
    return folder / "run" / "model", rows, tmp_path_factory.mktemp("serve")


def test_every_request_format_answers_what_predict_writes_and_bad_ones_get_a_400(served_rows):
    model, rows, tmp = served_rows
    want = predicted(model, rows, tmp)
    server = Server(tmp / "workdir", f"model={model}", "serve.workers=2")
    try:
        records = json.loads(rows.to_json(orient="records"))
        bodies = {
            "dataframe_split": (split_body(rows), "application/json"),
            "dataframe_records": (json.dumps({"dataframe_records": records}).encode(), "application/json"),
            "instances": (json.dumps({"instances": records}).encode(), "application/json; charset=utf-8"),
            "inputs as columns": (json.dumps({"inputs": {c: json.loads(rows[c].to_json(orient="values")) for c in rows.columns}}).encode(),
                                  "application/json"),
            "csv": (rows.to_csv(index=False).encode(), "text/csv"),
            "raw rows": (rows.to_csv(index=False).encode(), "text/x-ctr-rows"),  # the log's own layout (a header)
        }
        for name, (body, content_type) in bodies.items():
            status, answer, version = server.post(body, content_type)
            assert status == 200, (name, answer)
            np.testing.assert_allclose(probabilities(answer), want, atol=1e-6, err_msg=name)
            assert version == str(model.resolve())
        one = [server.post(split_body(rows.iloc[[i]]))[1] for i in (0, 7)]  # a request of one row
        np.testing.assert_allclose([probabilities(a)[0] for a in one], want[[0, 7]], atol=1e-6)

        huge_body = json.loads(split_body(rows))
        price = huge_body["dataframe_split"]["columns"].index("price")
        for row in huge_body["dataframe_split"]["data"]:
            row[price] = 10**399
        huge = json.dumps(huge_body).encode()
        bad = {
            "missing column": (split_body(rows.drop(columns=["tags"])), "'tags'"),
            "word in a number": (split_body(rows.assign(price=["cheap"] * len(rows))),
                                 "column 'price', row 0: 'cheap' is not a number"),
            "not JSON": (b'{"dataframe_split": [1, 2', "not JSON"),
            "no known key": (b'{"frame": []}', "exactly one of dataframe_split"),
            "short row": (json.dumps({"dataframe_split": {"columns": list(rows.columns),
                                                          "data": [[1, 2]]}}).encode(), "dataframe_split.data[0]"),
            "records not objects": (b'{"dataframe_records": [1]}', "dataframe_records[0]"),
            "400-digit integer": (huge, "column 'price', row 0: a number of 400 digits is past the float range"),
        }
        for name, (body, expected) in bad.items():
            status, answer, _ = server.post(body)
            assert status == 400 and expected in answer["message"], (name, answer)
        assert server.post(b"a,b\n1,2\n", "application/x-unknown")[0] == 400
        # the workers are alive and still answer correctly, also a good request between bad ones at once (a bad
        # one batched with good ones fails alone: a 400-digit integer failed the whole batch with 500s)
        results: list = [None] * 8
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(
            k, server.post(split_body(rows) if k % 2 else (huge if k % 4 else b"{bad")))) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r[0] for r in results] == [400, 200] * 4
        for status, answer, _ in results[1::2]:
            np.testing.assert_allclose(probabilities(answer), want, atol=1e-6)

        status, version = server.get("/version")
        assert json.loads(version)["model"] == str(model.resolve())
        metrics = server.get("/metrics")[1].decode()
        count = {status: float(line.split()[-1]) for status in ("200", "400") for line in metrics.splitlines()
                 if line.startswith(f'ctr_serve_requests_total{{status="{status}"}}')}
        assert count == {"200": len(bodies) + 2 + 4, "400": len(bad) + 1 + 4}, count  # summed over both workers
        assert "ctr_serve_batch_rows_bucket" in metrics and 'ctr_serve_request_seconds_recent{quantile="0.99"}' in metrics
    finally:
        server.stop()


def test_a_version_published_under_load_is_swapped_in_without_losing_or_mixing_answers(served_rows):
    """The watched folder gets day_1/model (int8 tables) while 6 clients send requests: every request is
    answered (200), each answer is wholly one version's — the one its X-Model-Version names — and after
    the swap the int8 version answers, equal to predict with the int8 folder."""
    from pipeline.serving.export import export_model

    model, rows, tmp = served_rows
    watched = tmp / "daily"
    export_model(model, watched / "day_0" / "model")
    export_model(model, tmp / "int8", "int8")
    want = {"day_0": predicted(watched / "day_0" / "model", rows, tmp), "day_1": predicted(tmp / "int8", rows, tmp)}
    assert np.abs(want["day_0"] - want["day_1"]).max() > 1e-5  # the versions are told apart by their answers
    server = Server(tmp / "workdir_swap", f"model={watched / 'day_0' / 'model'}", f"serve.watch={watched}",
                    "serve.watch_interval_s=0.5")
    answers: list[tuple[int, int, dict, str | None]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            start = (k * 7 + i) % 30
            status, answer, version = server.post(split_body(rows.iloc[start:start + 10]))
            answers.append((start, status, answer, version))
            i += 1

    clients = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    try:
        for t in clients:
            t.start()
        time.sleep(2)
        (watched / "day_1").mkdir()
        os.rename(tmp / "int8", watched / "day_1" / "model")  # published as a daily run does: by rename
        deadline = time.time() + 120
        while "day_1" not in json.loads(server.get("/version")[1])["model"]:
            assert time.time() < deadline, "the published version was not swapped in"
            time.sleep(0.2)
        time.sleep(2)
    finally:
        stop.set()
        for t in clients:
            t.join()
        server.stop()
    assert answers and all(status == 200 for _, status, _, _ in answers), [a for a in answers if a[1] != 200][:3]
    seen = []
    for start, _, answer, version in answers:
        day = "day_1" if "day_1" in version else "day_0"
        np.testing.assert_allclose(probabilities(answer), want[day][start:start + 10], atol=1e-6)
        seen.append(day)
    assert "day_0" in seen and seen[-1] == "day_1" and seen.count("day_1") >= 6, seen[-10:]


def test_recent_latency_quantiles_keep_moving_past_the_window():
    """Past WINDOW requests the quantiles still follow the newest ones (they froze once the window was full)."""
    from pipeline.server import metrics

    for _ in range(metrics.WINDOW):
        metrics.observe(200, 1.0)
    for _ in range(metrics.WINDOW):
        metrics.observe(200, 0.001)
    newest = list(metrics._recent)[-metrics.WINDOW:]
    # the gauge was last set at most 99 requests ago: its median is that of a window of mostly fast requests
    assert metrics.RECENT.labels("0.5")._value.get() == pytest.approx(float(np.median(newest)))
