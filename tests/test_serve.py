"""``ctr serve`` as a real server on 127.0.0.1 (2 worker processes): every request format answers what
``ctr predict`` writes for the same rows (``/rank`` what ``/invocations`` answers for its rows expanded), bad requests get a 400 naming the column or field and never
kill a worker, ``/metrics`` counts what was sent, a flood of 64 clients is shed with 503 while memory
stays bounded and ``/ping`` answers, and new versions published under load are swapped in on both
workers with no request lost and no answer mixing versions (float32 → int8 → int4, each checked
against predict), the versions no worker uses leaving the serve directory."""

from __future__ import annotations

import http.client
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
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.server.requests import ARROW_STREAM
from tests.conftest import PYTHON, ROOT, free_port, subprocess_env


def predicted(model: Path, rows: pd.DataFrame, folder: Path) -> np.ndarray:
    """``ctr predict``'s probabilities of ``rows`` (its function, in this process)."""
    from pipeline.scoring.prediction import PredictArgs, run

    rows.to_csv(folder / "rows.csv", index=False)
    run(PredictArgs(checkpoint=str(model), input=str(folder / "rows.csv"), output=str(folder / "rows.parquet")))
    return pd.read_parquet(folder / "rows.parquet")["probability"].to_numpy()


class Server:
    """``ctr serve`` with ``args``; ready once every worker serves its model (says so in ``workers/``)."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.port = free_port()
        workers = int(next((a.split("=")[1] for a in args if a.startswith("serve.workers=")), 1))
        self.proc = subprocess.Popen([PYTHON, "-m", "pipeline.commands.serve", *args, f"serve.port={self.port}",
                                      f"serve.dir={workdir}"], cwd=ROOT, env=subprocess_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.time() + 180
        while True:
            try:
                uses = [json.loads(p.read_text()) for p in (workdir / "workers").glob("*.json")]
                if self.get("/ping")[0] == 200 and len(uses) == workers and all(u["serving"] for u in uses):
                    break
            except (OSError, ValueError):  # not answering yet; a worker's file being replaced
                pass
            assert self.proc.poll() is None and time.time() < deadline, self.proc.stderr.read().decode()[-3000:]
            time.sleep(0.5)

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.status, r.read()

    def post(self, body: bytes, content_type: str = "application/json", path: str = "/invocations"
             ) -> tuple[int, dict, str | None]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=body,
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
    server = Server(tmp / "workdir", f"model={model}", "serve.workers=2", f"serve.max_queued_mb={FLOOD_BOUND_MB}")
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

        # POST /rank: the first row's user and time as the context of every row's price and tags, as JSON and as an
        # Arrow stream, answers what /invocations answers for the rows so expanded (this model has a sequence
        # feature: the expanded path; the shared-context path is tested model by model in tests/test_ranking.py)
        context = {c: str(rows.iloc[0][c]) for c in ("user_id", "click_time")}
        _, expanded, _ = server.post(split_body(rows.assign(**context)))
        candidates = {c: json.loads(rows[c].to_json(orient="values")) for c in ("price", "tags")}
        table = pa.table(candidates).replace_schema_metadata({"context": json.dumps(context)})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        for body, content_type in ((json.dumps({"context": context, "candidates": candidates}).encode(),
                                    "application/json"), (sink.getvalue().to_pybytes(), ARROW_STREAM)):
            status, answer, version = server.post(body, content_type, path="/rank")
            assert status == 200 and version == str(model.resolve()), answer
            np.testing.assert_allclose(probabilities(answer), probabilities(expanded), atol=1e-6)
        bad_rank = {
            "a column in both": ({"context": {**context, "price": 3}, "candidates": candidates}, "column 'price' is "
                                 "in both context and candidates"),
            "a context column per candidate": ({"context": {**context, "user_id": ["u1", "u2"]},
                                                "candidates": candidates}, "context.user_id: expected one value"),
            "a candidate column missing": ({"context": context, "candidates": {"price": candidates["price"]}},
                                           "lacks column 'tags'"),
            "no candidate": ({"context": context, "candidates": {"price": [], "tags": []}}, "no candidate to rank"),
        }
        for name, (doc, expected) in bad_rank.items():
            status, answer, _ = server.post(json.dumps(doc).encode(), path="/rank")
            assert status == 400 and expected in answer["message"], (name, answer)
        too_large = json.dumps({"context": context, "candidates": candidates}).encode() + b" " * (FLOOD_BOUND_MB << 20)
        status, answer, _ = server.post(too_large, path="/rank")
        assert status == 413 and "serve.max_queued_mb" in answer["message"], answer
        status, answer, _ = server.post(json.dumps({"context": context, "candidates": candidates}).encode(),
                                        path="/rank")  # and the worker ranks on
        assert status == 200 and np.allclose(probabilities(answer), probabilities(expanded), atol=1e-6)

        # 64 clients flood it with 6 MiB bodies (the rows, then spaces) for 4 s: each worker holds at most
        # serve.max_queued_mb of them, sheds the rest with 503 + Retry-After, and keeps answering /ping
        body = split_body(rows) + b" " * (6 << 20)
        workers = [int(p.stem) for p in (tmp / "workdir" / "workers").glob("*.json")]
        assert len(workers) == 2
        idle = {pid: _status_kib(pid, "VmRSS") for pid in workers}
        for pid in workers:  # the peak resident size (VmHWM) counts from here
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        statuses, pings = flood(server.port, body, clients=64, seconds=4)
        grown = {pid: (_status_kib(pid, "VmHWM") - idle[pid]) / 1024 for pid in workers}
        assert statuses.get(503, 0) > 0 and statuses.get(200, 0) > 0 and set(statuses) <= {200, 503}, statuses
        # the bound is 8 MiB of bodies; unbounded, the workers grew by 240-343 MiB in the same flood
        assert max(grown.values()) < 128, grown
        assert len(pings) >= 5 and max(pings) < 5.0, pings
        metrics = server.get("/metrics")[1].decode()
        shed = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("ctr_serve_shed_total"))
        assert shed == statuses[503]
        status, answer, _ = server.post(split_body(rows))  # and after it, answers as before
        assert status == 200
        np.testing.assert_allclose(probabilities(answer), want, atol=1e-6)
    finally:
        server.stop()


FLOOD_BOUND_MB = 8


def _status_kib(pid: int, key: str) -> int:
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(key + ":"))


def flood(port: int, body: bytes, clients: int, seconds: float) -> tuple[dict[int, int], list[float]]:
    """``clients`` threads posting ``body`` without pause for ``seconds`` (a 503 must say Retry-After), and one
    that GETs /ping every 0.2 s; returns the count of each status and the /ping latencies."""
    statuses: dict[int, int] = {}
    pings: list[float] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                conn.request("POST", "/invocations", body, {"Content-Type": "application/json"})
                answer = conn.getresponse()
                answer.read()
                assert answer.status != 503 or answer.getheader("Retry-After") == "1"
                with lock:
                    statuses[answer.status] = statuses.get(answer.status, 0) + 1
            finally:
                conn.close()

    def ping() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=30) as r:
                assert r.status == 200
            pings.append(time.perf_counter() - t0)
            time.sleep(0.2)

    errors: list[BaseException] = []

    def guarded(target) -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 — reported by the test
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(client,)) for _ in range(clients)]
    threads.append(threading.Thread(target=guarded, args=(ping,)))
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    return statuses, pings


def test_versions_published_under_load_swap_in_on_both_workers_and_old_ones_are_deleted(served_rows):
    """Two workers; the watched folder gets day_1 (int8 tables), then day_2 (int4), each published by rename once
    both workers serve the one before, while 6 clients send requests: every request is answered (200), each
    answer is wholly one version's — the one its X-Model-Version names, equal to predict with that folder —
    both workers end on day_2, and of the fused table buffers in the serve directory only day_2's stay
    (day_0's small-batch copy and day_1's are deleted once no worker uses them)."""
    from pipeline.model_folder.export import export_model

    model, rows, tmp = served_rows
    watched, workdir = tmp / "daily", tmp / "workdir_swap"
    days = {"day_0": "none", "day_1": "int8", "day_2": "int4"}
    for day, kind in days.items():
        export_model(model, (watched if day == "day_0" else tmp / "exports") / day / "model", kind)
    want = {day: predicted((watched if day == "day_0" else tmp / "exports") / day / "model", rows, tmp) for day in days}
    assert min(np.abs(want[a] - want[b]).max() for a in days for b in days if a < b) > 1e-5  # told apart by answers
    server = Server(workdir, f"model={watched / 'day_0' / 'model'}", f"serve.watch={watched}",
                    "serve.watch_interval_s=0.5", "serve.workers=2")
    answers: list[tuple[int, int, dict, str | None]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            start = (k * 7 + i) % 30
            status, answer, version = server.post(split_body(rows.iloc[start:start + 10]))
            answers.append((start, status, answer, version))
            i += 1

    def served_by_workers() -> set[str]:
        uses = [json.loads(p.read_text()) for p in (workdir / "workers").glob("*.json")]
        return {Path(u["serving"]).parent.name for u in uses if len(u["folders"]) == 1} if len(uses) == 2 else set()

    clients = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    try:
        for t in clients:
            t.start()
        for day in list(days)[1:]:
            time.sleep(1)
            os.rename(tmp / "exports" / day, watched / day)  # published as a daily run does: by rename
            deadline = time.time() + 120
            while served_by_workers() != {day}:
                assert time.time() < deadline, f"{day} was not swapped in on both workers: {served_by_workers()}"
                time.sleep(0.2)
        deadline = time.time() + 60
        while len(list((workdir / "fused").iterdir())) > 1:  # the watcher prunes every 0.5 s
            assert time.time() < deadline, sorted(p.name for p in (workdir / "fused").iterdir())
            time.sleep(0.2)
        used = {name for p in (workdir / "workers").glob("*.json") for name in json.loads(p.read_text())["fused"]}
        assert [p.name for p in (workdir / "fused").iterdir()] == list(used)  # day_2's, which both workers map
        time.sleep(1)
    finally:
        stop.set()
        for t in clients:
            t.join()
        server.stop()
    assert answers and all(status == 200 for _, status, _, _ in answers), [a for a in answers if a[1] != 200][:3]
    seen = []
    for start, _, answer, version in answers:
        day = Path(version).parent.name
        np.testing.assert_allclose(probabilities(answer), want[day][start:start + 10], atol=1e-6, err_msg=day)
        seen.append(day)
    assert set(seen) == set(days) and seen[-1] == "day_2" and seen.count("day_2") >= 6, seen[-10:]
    assert not list((workdir / "workers").glob("*.json"))  # the workers took their names back on exit


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


@pytest.fixture(scope="module")
def served_in_process(served_rows):
    """The model of ``served_rows`` loaded as a server worker loads it (small batches fused), and its answers
    to the rows as predict writes them."""
    from pipeline.server.app import load
    from pipeline.server.versions import Version

    model, rows, tmp = served_rows
    return load(Version("fuzz", str(model)), tmp / "fuzz", 64), rows, predicted(model, rows.iloc[:3], tmp)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**400, 10**400), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.text(max_size=4), max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@st.composite
def _bodies(draw, columns: list[str]) -> tuple[bytes, str]:
    """A request body: one of MLflow's JSON forms over the model's columns (some dropped, some extra) with
    values of any JSON type, any JSON at all, a CSV, or bytes."""
    kind = draw(st.sampled_from(["split", "records", "instances", "inputs", "json", "csv", "bytes"]))
    cols = draw(st.lists(st.sampled_from(columns + ["extra"]), unique=True, max_size=len(columns) + 1))
    cols = cols if draw(st.booleans()) else columns
    n = draw(st.integers(0, 3))
    rows = [[draw(_VALUES) for _ in cols] for _ in range(n)]
    if kind == "split":
        body: object = {"dataframe_split": {"columns": cols, "data": rows if draw(st.booleans()) else
                                            draw(st.lists(st.lists(_VALUES, max_size=4), max_size=2))}}
    elif kind in ("records", "instances"):
        body = {"dataframe_records" if kind == "records" else "instances": [dict(zip(cols, r)) for r in rows]}
    elif kind == "inputs":
        body = {"inputs": {c: [r[i] for r in rows] for i, c in enumerate(cols)}}
    elif kind == "json":
        body = draw(st.recursive(_VALUES, lambda inner: st.lists(inner, max_size=3) |
                                 st.dictionaries(st.sampled_from(["dataframe_split", "instances", "columns", "data"]),
                                                 inner, max_size=2), max_leaves=6))
    elif kind == "csv":
        text = ",".join(cols) + "\n" + "\n".join(",".join(str(v) for v in r) for r in rows)
        return text.encode(), "text/csv"
    else:
        return draw(st.binary(max_size=64)), draw(st.sampled_from(["application/json", "text/csv"]))
    return json.dumps(body, default=str).encode(), "application/json"


def test_a_csv_header_not_in_utf8_after_empty_lines_is_a_400():
    """Arrow skips empty lines before a CSV header: the header checked is the one it reads (a fuzzed body,
    ``b"\\n\\x80\\r"``, reached Arrow's column names undecoded and answered 500)."""
    from pipeline.server.requests import RequestError, parse

    with pytest.raises(RequestError, match="text/csv body"):
        parse(b"\n\x80\r", "text/csv")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_any_body_is_answered_or_refused_alone_and_never_fails_a_good_request_beside_it(served_in_process, data):
    """Fuzzed bodies (Hypothesis), each batched with a good request as the scoring thread batches them: the
    fuzzed one gets probabilities (one per row) or a 400 naming what is wrong — never another exception, which
    would be a 500 — and the good one its right answer (a 400-digit integer failed whole batches with 500s)."""
    from pipeline.server.batcher import answer_batch
    from pipeline.server.requests import RequestError

    served, rows, want = served_in_process
    body, content_type = data.draw(_bodies(list(rows.columns)))
    outcomes, _ = answer_batch(served, [(body, content_type), (split_body(rows.iloc[:3]), "application/json")], 4096)
    assert isinstance(outcomes[0], (bytes, RequestError)), (body[:300], outcomes[0])
    if isinstance(outcomes[0], RequestError):
        assert str(outcomes[0]).strip(), body[:300]
    np.testing.assert_allclose(probabilities(json.loads(outcomes[1])), want, atol=1e-6)


@pytest.mark.parametrize("body", [
    pytest.param(b"\r\x00", id="header ended by a lone CR, as Arrow ends lines"),
    pytest.param(b"\x80\n", id="header not UTF-8, which Arrow does not check"),
])
def test_malformed_csv_bodies_are_refused_with_a_reason(body):
    """CSV bodies Hypothesis found failing with 500s: now a 400 (RequestError) naming the body."""
    from pipeline.server.requests import RequestError, parse

    with pytest.raises(RequestError, match="text/csv body"):
        parse(body, "text/csv")


def _serve_settings(*overrides: str):
    """``serve.*`` as ``ctr serve`` parses them from conf/serving/serve.yaml."""
    from hydra import compose, initialize_config_module

    from pipeline.commands.args import command_args
    from pipeline.commands.serve import ServeArgs

    with initialize_config_module("ctr_conf.serving", version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["model=unused", *overrides])
    return command_args(cfg, ServeArgs).serve


def _post(app, messages: list[dict], content_length: int | None) -> list[dict]:
    """One ``POST /invocations`` through the worker's ASGI app: the client's messages, and what the app sent."""
    import asyncio

    sent: list[dict] = []
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json")] + \
        ([(b"content-length", str(content_length).encode())] if content_length is not None else [])
    asyncio.run(app({"type": "http", "path": "/invocations", "method": "POST", "headers": headers}, receive, send))
    return sent


def test_a_body_larger_than_a_worker_holds_gets_413_naming_the_bound_not_503_forever():
    from pipeline.server.app import ScoringApp

    app = ScoringApp(_serve_settings("serve.max_queued_mb=1", "serve.dir=/tmp"))
    chunk = {"type": "http.request", "body": b"x" * (1 << 19), "more_body": True}
    last = {"type": "http.request", "body": b"x" * (1 << 19) + b"x", "more_body": False}
    for declared in (2 * (1 << 19) + 1, None):  # said by Content-Length, or found reading a chunked body
        sent = _post(app, [chunk, last], declared)
        assert sent[0]["status"] == 413, sent
        assert "serve.max_queued_mb=1 MiB" in json.loads(sent[1]["body"])["message"]
        assert (app.admission.bytes, app.admission.requests) == (0, 0)


def test_a_client_gone_before_its_body_arrived_gets_nothing_scored():
    """A disconnect is not the end of a body: the part that came is dropped, never scored (no model is loaded
    here: scoring it would answer 500), and the worker holds nothing for it afterwards."""
    from pipeline.server.app import ScoringApp

    app = ScoringApp(_serve_settings("serve.dir=/tmp"))
    for declared in (100, None):
        sent = _post(app, [{"type": "http.request", "body": b'{"instances": [', "more_body": True}], declared)
        assert sent == [] and (app.admission.bytes, app.admission.requests) == (0, 0)


def test_each_serve_default_stands_once():
    """The defaults are conf/serving/serve.yaml's alone: the typed settings have none, the workers get the parsed
    object (no positional copy), and the docs refer to the config instead of restating the numbers."""
    import dataclasses

    from pipeline.server.settings import ServeSettings

    fields = dataclasses.fields(ServeSettings)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    parsed = _serve_settings()
    assert [f.name for f in fields] == list(dataclasses.asdict(parsed))
    yaml = (ROOT / "conf" / "serving" / "serve.yaml").read_text()
    for f in fields:  # each key described where its default stands
        line = next(x for x in yaml.splitlines() if x.strip().startswith(f"{f.name}:"))
        assert "#" in line or f.name in ("host", "port"), line
    docs = (ROOT / "docs" / "model_use.md").read_text()
    assert "conf/serving/serve.yaml" in docs
    for f in fields:
        value = getattr(parsed, f.name)
        if isinstance(value, (int, float)) and value not in (0, 1):
            assert f"`serve.{f.name}` ({value:,g})" not in docs and f"`serve.{f.name}` ({value:g})" not in docs


def test_a_server_without_serve_dir_removes_its_temporary_folder_on_sigterm_and_ctrl_c(served_rows, tmp_path):
    """The downloaded model and fused table copies live in a temporary folder (gigabytes with real tables): one
    server per signal, both started at once; /version names the model, not that folder."""
    model, _, _ = served_rows
    servers = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        tmp = tmp_path / sig.name
        tmp.mkdir()
        port = free_port()
        proc = subprocess.Popen([PYTHON, "-m", "pipeline.commands.serve", f"model={model}", f"serve.port={port}"],
                                cwd=ROOT, env=subprocess_env(TMPDIR=str(tmp)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        servers[sig] = (proc, port, tmp)
    deadline = time.time() + 180
    for sig, (proc, port, tmp) in servers.items():
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=5) as r:
                    about = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-3000:]
                time.sleep(0.5)
        assert about["model"] == str(model.resolve()) and "folder" not in about
        assert [p.name for p in tmp.iterdir() if p.name.startswith("ctr-serve-")], "no temporary folder to remove"
        os.kill(proc.pid, sig)  # the server process alone, as a terminal's Ctrl-C or a supervisor's stop
    for sig, (proc, port, tmp) in servers.items():
        proc.wait(timeout=90)
        proc.stderr.close()
        assert [p.name for p in tmp.iterdir() if p.name.startswith("ctr-serve-")] == [], sig.name
