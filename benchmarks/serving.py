"""Serving latency and throughput: a real ``mlflow models serve`` on 127.0.0.1 against the in-process scorer.

    python benchmarks/serving.py --model <model folder> --rows <raw file of the model's dataset> \
        [--quantize none int8] [--sizes 1 10 100 1000] [--clients 1 4 16] [--workers 1]

For each table format (float32, and int8 unless left out) the script exports the model folder
(``ctr export quantize=...``), saves it as the project's MLflow pyfunc model, starts
``mlflow models serve --env-manager local`` on a free port, and sends ``POST /invocations`` requests
of 1, 10, 100 and 1,000 raw rows (``dataframe_split`` JSON, rows taken from ``--rows``) from 1, 4 and 16
concurrent clients (threads, one keep-alive connection each), each cell bounded by ``--requests``
requests per client and ``--seconds``. It prints p50 / p95 / p99 latency and rows/s per cell, and the
in-process scorer's rows/s (the same rows, no HTTP) as the limit: the baseline. The clients run on the
same machine as the server and take CPU from it; with 2 cores the 16-client rows show queueing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def request_body(frame, rows: int, offset: int) -> bytes:
    part = frame.iloc[offset % (len(frame) - rows + 1):][:rows]
    return json.dumps({"dataframe_split": {"columns": list(part.columns),
                                           "data": part.astype(object).where(part.notna(), None).values.tolist()}}
                      ).encode()


def serve(model_dir: Path, port: int, workers: int, threads: int) -> subprocess.Popen:
    bin_dir = Path(sys.executable).parent  # mlflow starts uvicorn from PATH
    env = {**os.environ, "CTR_SERVING_THREADS": str(threads), "PYTHONPATH": str(ROOT),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    mlflow = bin_dir / "mlflow"
    proc = subprocess.Popen([str(mlflow), "models", "serve", "-m", str(model_dir), "--env-manager", "local",
                             "-h", "127.0.0.1", "-p", str(port), "--workers", str(workers)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlflow models serve exited: {proc.stderr.read()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ping")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("mlflow models serve did not answer /ping within 180 s")


def load(port: int, bodies: list[bytes], clients: int, requests: int, seconds: float) -> tuple[list[float], float]:
    """Latencies (s) of every request and the wall time of the cell."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine = []
        for i in range(requests):
            if time.monotonic() > stop:
                break
            body = bodies[(k * requests + i) % len(bodies)]
            t0 = time.perf_counter()
            conn.request("POST", "/invocations", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
            mine.append(time.perf_counter() - t0)
            if response.status != 200:
                raise SystemExit(f"HTTP {response.status}: {payload[:500]!r}")
        with lock:
            latencies.extend(mine)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - t0


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder (a run's <output>/model, or ctr export's)")
    p.add_argument("--rows", required=True, help="a raw file of the model's dataset (rows to send)")
    p.add_argument("--quantize", nargs="+", default=["none", "int8"])
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 10, 100, 1000])
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=200, help="at most this many requests per client and cell")
    p.add_argument("--seconds", type=float, default=20.0, help="at most this long per cell")
    p.add_argument("--workers", type=int, default=1, help="mlflow models serve --workers")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker (CTR_SERVING_THREADS)")
    p.add_argument("--no-signature", action="store_true", help="save the MLflow model without its signature")
    args = p.parse_args()

    import torch

    from pipeline.data.other_readers import open_reader
    from pipeline.data.store import SplitArrays
    from pipeline.runtime.launch import free_port
    from pipeline.serving.export import export_model
    from pipeline.serving.scorer import Scorer
    from pipeline.tracking.pyfunc import save_pyfunc

    float_scorer = Scorer(args.model)
    reading = float_scorer.reading(label=True)
    table = next(iter(open_reader([Path(args.rows)], reading, 32 << 20, "error", "rows to send")))
    frame = table.drop_columns([reading.label]).slice(0, 20_000).to_pandas()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    print(f"{len(frame):,} rows of {args.rows}; server: {args.workers} worker(s) × {args.threads} thread(s); "
          f"{os.cpu_count()} cores; clients on the same machine; MLflow signature "
          f"{'off' if args.no_signature else 'on'}\n")
    print("| tables | rows/request | clients | requests | p50 ms | p95 ms | p99 ms | rows/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    limits = {}
    for q in args.quantize:
        folder = export_model(args.model, tmp / f"model_{q}", q)
        scorer = Scorer(folder)
        torch.set_num_threads(args.threads)
        arrays: SplitArrays = scorer.encode(scorer.frame_block(frame))
        scorer.score(arrays)
        t0 = time.perf_counter()
        repeats = 5
        for _ in range(repeats):
            scorer.score(arrays)
        limits[q] = (len(frame) * repeats / (time.perf_counter() - t0), scorer.table_bytes())
        t0 = time.perf_counter()
        for k in range(20):
            scorer.score_frame(frame.iloc[k * 1000:(k + 1) * 1000])
        limits[q] += (20_000 / (time.perf_counter() - t0),)
        pyfunc = save_pyfunc(folder, frame.head(5), tmp / f"pyfunc_{q}", signature=not args.no_signature)
        port = free_port()
        server = serve(pyfunc, port, args.workers, args.threads)
        try:
            for size in args.sizes:
                bodies = [request_body(frame, size, i * size) for i in range(64)]
                load(port, bodies[:4], 1, 4, 10.0)  # warm-up
                for clients in args.clients:
                    latencies, wall = load(port, bodies, clients, args.requests, args.seconds)
                    ms = [x * 1e3 for x in latencies]
                    print(f"| {q} | {size:,} | {clients} | {len(ms)} | {quantile(ms, 0.5):.2f} | "
                          f"{quantile(ms, 0.95):.2f} | {quantile(ms, 0.99):.2f} | {len(ms) * size / wall:,.0f} |",
                          flush=True)
        finally:
            server.terminate()
            server.wait(30)
    print("\nIn-process scorer (the limit: no HTTP, no JSON), same rows:\n")
    print("| tables | table bytes | encoded arrays, rows/s | raw rows, 1,000 a call, rows/s |")
    print("|---|---:|---:|---:|")
    base = limits.get("none", next(iter(limits.values())))[1]
    for q, (encoded, nbytes, raw) in limits.items():
        print(f"| {q} | {nbytes / 2**20:,.1f} MiB ({nbytes / base:.2f}×) | {encoded:,.0f} | {raw:,.0f} |")


if __name__ == "__main__":
    main()
