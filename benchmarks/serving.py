"""Serving latency and throughput: ``ctr serve`` against ``mlflow models serve``, same model, same requests,
both real servers on 127.0.0.1, measured in one run.

    python benchmarks/serving.py --model <model folder> --rows <raw file of the model's dataset> \
        [--quantize none] [--sizes 1 10 1000] [--clients 1 4 16 64] [--workers 1] [--seconds 8] [--collection]

For each table format (``--quantize``: none = float32, int8, ...) the script exports the model folder
(``ctr export``), saves it as the project's MLflow pyfunc model (with its signature, as a run logs it),
and starts each server with ``--workers`` processes of 1 PyTorch thread. Requests are raw rows
(``dataframe_split`` JSON, taken from ``--rows``) of 1, 10 and 1,000 rows, sent by 1, 4, 16 and 64
concurrent clients — one asyncio process, one keep-alive connection per client, each cell bounded by
``--requests`` requests per client and ``--seconds`` — after a warm-up. It prints p50 / p99 latency,
requests/s and rows/s per cell, the ratios of ``ctr serve``'s requests/s and p50 to MLflow's (with
``--collection`` also of ``ctr serve serve.small_batch_rows=0``: the float collection for every model
call, the server before small batches went to the fused kernel), and checks that
both servers answer the same probabilities (1e-6). The clients share the machine's cores with the
servers: on 2 cores, absolute numbers are lower than on a separate client machine.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from work_folder import ROOT, child_env, work_folder  # noqa: E402  (beside this file)

sys.path.insert(0, str(ROOT))


def stop(server: subprocess.Popen) -> None:
    """End a server and every process it started (workers that outlive it would take the cores from the next
    server measured: MLflow's kept scoring their backlog after its parent had exited)."""
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(server.pid, signal.SIGKILL)


def request_body(columns: list[str], data: list[list], rows: int, offset: int) -> bytes:
    start = offset % (len(data) - rows + 1)
    return json.dumps({"dataframe_split": {"columns": columns, "data": data[start:start + rows]}}).encode()


def start(kind: str, model: Path, pyfunc: Path, port: int, workers: int, workdir: Path,
          extra: tuple[str, ...] = (), threads: int = 1) -> subprocess.Popen:
    bin_dir = Path(sys.executable).parent  # mlflow starts uvicorn from PATH
    env = child_env({"CTR_SERVING_THREADS": str(threads),
                     "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    if kind == "mlflow":
        cmd = [str(bin_dir / "mlflow"), "models", "serve", "-m", str(pyfunc), "--env-manager", "local",
               "-h", "127.0.0.1", "-p", str(port), "--workers", str(workers)]
    else:
        cmd = [sys.executable, "-m", "pipeline.commands.serve", f"model={model}", f"serve.port={port}",
               f"serve.workers={workers}", f"serve.threads={threads}", f"serve.dir={workdir}"]
        if kind == "ctr_collection":  # the float collection for every call (before small batches went fused)
            cmd.append("serve.small_batch_rows=0")
        cmd += list(extra)
    proc = subprocess.Popen(cmd, env=env, cwd=workdir.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} server exited: {proc.stderr.read()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ping")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{kind} server did not answer /ping within 180 s")


async def _client(port: int, bodies: list[bytes], k: int, requests: int, stop: float, out: list[float],
                  answers: dict[int, bytes], path: str, content_type: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i in range(requests):
            if time.monotonic() > stop:
                break
            j = (k * requests + i) % len(bodies)
            body = bodies[j]
            t0 = time.perf_counter()
            writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: %s\r\n"
                         b"Content-Length: %d\r\n\r\n" % (path.encode(), content_type.encode(), len(body)) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = {h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip() for h in lines[1:] if ":" in h}
            payload = await reader.readexactly(int(fields["content-length"]))
            out.append(time.perf_counter() - t0)
            if int(lines[0].split()[1]) != 200:
                raise SystemExit(f"HTTP {lines[0]}: {payload[:500]!r}")
            answers.setdefault(j, payload)
    finally:
        writer.close()


def load(port: int, bodies: list[bytes], clients: int, requests: int, seconds: float, path: str = "/invocations",
         content_type: str = "application/json") -> tuple[list[float], float, dict[int, bytes]]:
    """Latencies (s) of every request, the wall time of the cell, one answer per body sent."""
    latencies: list[float] = []
    answers: dict[int, bytes] = {}

    async def cell() -> float:
        stop = time.monotonic() + seconds
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(port, bodies, k, requests, stop, latencies, answers, path, content_type)
                               for k in range(clients)))
        return time.perf_counter() - t0

    return latencies, asyncio.run(cell()), answers


def probabilities(answer: bytes) -> np.ndarray:
    return np.array([p["probability"] for p in json.loads(answer)["predictions"]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder (a run's <output>/model, or ctr export's)")
    p.add_argument("--rows", required=True, help="a raw file of the model's dataset (rows to send)")
    p.add_argument("--quantize", nargs="+", default=["none"])
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 10, 1000])
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=2000, help="at most this many requests per client and cell")
    p.add_argument("--seconds", type=float, default=8.0, help="at most this long per cell")
    p.add_argument("--workers", type=int, default=1, help="server processes (both servers)")
    p.add_argument("--collection", action="store_true",
                   help="also ctr serve with serve.small_batch_rows=0 (the float collection for every model call)")
    p.add_argument("--work", default=None, help="folder for the models and servers (default: a temporary one)")
    p.add_argument("--rank", action="store_true", help="ranking requests instead (POST /rank): --sizes candidates "
                   "sharing one context of the --context columns, against the same rows expanded")
    p.add_argument("--context", nargs="*", default=None,
                   help="with --rank: the context's columns (default: the first half of the columns the model reads)")
    p.add_argument("--threads", type=int, default=1, help="PyTorch threads per worker (both servers)")
    p.add_argument("--rank-dense", default="auto", help="with --rank: ctr serve's serve.rank_dense (fp32, bf16, auto)")
    args = p.parse_args()
    with work_folder(args.work, "bench-serving-") as tmp:
        (measure_rank if args.rank else measure)(args, tmp)


def measure(args: argparse.Namespace, tmp: Path) -> None:
    from pipeline.data.other_readers import open_reader
    from pipeline.runtime.launch import free_port
    from pipeline.model_folder.export import export_model
    from pipeline.scoring.scorer import Scorer
    from pipeline.tracking.pyfunc import save_pyfunc

    reading = Scorer(args.model).reading(label=True)
    table = next(iter(open_reader([Path(args.rows)], reading, 32 << 20, "error", "rows to send")))
    frame = table.drop_columns([reading.label]).slice(0, 20_000).to_pandas()
    columns, data = list(frame.columns), frame.astype(object).where(frame.notna(), None).values.tolist()
    print(f"{len(frame):,} rows of {args.rows}; each server: {args.workers} worker(s) × 1 thread; {os.cpu_count()} "
          f"cores, shared with the clients (one asyncio process)\n")
    kinds = ("mlflow", "ctr", *(["ctr_collection"] if args.collection else []))
    print("| tables | rows/request | clients | server | requests | p50 ms | p99 ms | requests/s | rows/s | "
          "requests/s ÷ mlflow's | p50 ÷ mlflow's |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for q in args.quantize:
        folder = export_model(args.model, tmp / f"model_{q}", q)
        pyfunc = save_pyfunc(folder, frame.head(5), tmp / f"pyfunc_{q}")
        results: dict[tuple[str, int, int], tuple] = {}
        for kind in kinds:
            port = free_port()
            server = start(kind, folder, pyfunc, port, args.workers, tmp / f"serve_{q}", threads=args.threads)
            try:
                for size in args.sizes:
                    bodies = [request_body(columns, data, size, i * size) for i in range(64)]
                    load(port, bodies, 2, 20, 10.0)  # warm-up
                    for clients in args.clients:
                        results[kind, size, clients] = load(port, bodies, clients, args.requests, args.seconds)
            finally:
                stop(server)
        for size in args.sizes:
            for clients in args.clients:
                rps, p50 = {}, {}
                for kind in kinds:
                    latencies, wall, _ = results[kind, size, clients]
                    ms = np.array(latencies) * 1e3
                    rps[kind], p50[kind] = len(ms) / wall, np.percentile(ms, 50)
                    ratios = f"**{rps[kind] / rps['mlflow']:.1f}×** | **{p50[kind] / p50['mlflow']:.2f}×**" \
                        if kind != "mlflow" else " | "
                    print(f"| {q} | {size:,} | {clients} | {kind} | {len(ms)} | {p50[kind]:.2f} | "
                          f"{np.percentile(ms, 99):.2f} | {rps[kind]:,.0f} | {rps[kind] * size:,.0f} | {ratios} |",
                          flush=True)
                ctr_answers, mlflow_answers = results["ctr", size, clients][2], results["mlflow", size, clients][2]
                for j in set(ctr_answers) & set(mlflow_answers):
                    diff = np.abs(probabilities(ctr_answers[j]) - probabilities(mlflow_answers[j])).max()
                    if diff > 1e-6:
                        raise SystemExit(f"the servers disagree on request {j} of {size} rows: max |Δp| {diff:.2e}")
    print("\nBoth servers answered every request compared with the same probabilities (1e-6).")


def rank_bodies(columns: list[str], data: list[list], context: list[str], size: int, offset: int
                ) -> tuple[bytes, bytes, bytes]:
    """One ranking request of ``size`` candidates: its JSON body, its Arrow stream, and the same rows expanded
    (each candidate with the context's values) as ``dataframe_split``. The context: the first row's values of the
    ``context`` columns; the candidates: the other columns of the rows."""
    import pyarrow as pa

    start = offset % (len(data) - size + 1)
    rows = data[start:start + size]
    at = {c: i for i, c in enumerate(columns)}
    ctx = {c: rows[0][at[c]] for c in context}
    candidates = {c: [r[at[c]] for r in rows] for c in columns if c not in ctx}
    table = pa.table(candidates).replace_schema_metadata({"context": json.dumps(ctx)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    expanded = [[ctx.get(c, r[at[c]]) for c in columns] for r in rows]
    return (json.dumps({"context": ctx, "candidates": candidates}).encode(), sink.getvalue().to_pybytes(),
            json.dumps({"dataframe_split": {"columns": columns, "data": expanded}}).encode())


def forward_bound(model_folder: Path, expanded: bytes, threads: int, repeats: int = 50) -> float:
    """The model alone on the expanded rows, pre-encoded (``threads`` PyTorch threads, as a server worker): median ms
    a call."""
    import torch

    from pipeline.data.batches import make_batch
    from pipeline.scoring.scorer import Scorer

    torch.set_num_threads(threads)
    scorer = Scorer(model_folder)
    split = json.loads(expanded)["dataframe_split"]
    arrays = scorer.encode_columns(dict(zip(split["columns"], zip(*split["data"]))), len(split["data"]))
    batch = make_batch(arrays, np.arange(len(arrays)), scorer.spec.kjt_keys, categorical=scorer.spec.categorical)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            scorer.model(batch.dense_features, batch.sparse_features)
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def measure_rank(args: argparse.Namespace, tmp: Path) -> None:
    """Ranking requests: ``ctr serve``'s /rank (JSON and Arrow) against the same rows expanded to /invocations of
    ``ctr serve`` and of ``mlflow models serve``, and the model's forward pass alone."""
    from pipeline.data.other_readers import open_reader
    from pipeline.runtime.launch import free_port
    from pipeline.scoring.scorer import Scorer
    from pipeline.server.requests import ARROW_STREAM
    from pipeline.tracking.pyfunc import save_pyfunc

    reading = Scorer(args.model).reading(label=True)
    table = next(iter(open_reader([Path(args.rows)], reading, 32 << 20, "error", "rows to send")))
    frame = table.drop_columns([reading.label]).slice(0, 20_000).to_pandas()
    columns, data = list(frame.columns), frame.astype(object).where(frame.notna(), None).values.tolist()
    read = [c for c in reading.read_columns if c != reading.label]
    context = args.context if args.context is not None else read[:len(read) // 2]
    print(f"{len(frame):,} rows of {args.rows}; context: {len(context)} columns ({', '.join(context[:6])}"
          f"{', ...' if len(context) > 6 else ''}), the other {len(read) - len(context)} per candidate; each server: "
          f"{args.workers} worker(s) × {args.threads} thread(s); {os.cpu_count()} cores, shared with the clients\n")
    pyfunc = save_pyfunc(Path(args.model), frame.head(5), tmp / "pyfunc")
    cells = {"ctr /rank JSON": ("ctr", "/rank", "application/json", 0),
             "ctr /rank Arrow": ("ctr", "/rank", ARROW_STREAM, 1),
             "ctr /invocations, rows expanded": ("ctr", "/invocations", "application/json", 2),
             "mlflow /invocations, rows expanded": ("mlflow", "/invocations", "application/json", 2)}
    bodies = {size: [rank_bodies(columns, data, context, size, i * size) for i in range(16)] for size in args.sizes}
    results: dict[tuple[str, int, int], tuple] = {}
    for kind in ("ctr", "mlflow"):
        port = free_port()
        server = start(kind, Path(args.model), pyfunc, port, args.workers, tmp / "serve",
                       (f"serve.rank_dense={args.rank_dense}",) if kind == "ctr" else (), args.threads)
        try:
            for name, (server_kind, path, content_type, form) in cells.items():
                if server_kind != kind:
                    continue
                for size in args.sizes:
                    sent = [b[form] for b in bodies[size]]
                    load(port, sent, 1, 5, 10.0, path, content_type)  # warm-up
                    for clients in args.clients:
                        results[name, size, clients] = load(port, sent, clients, args.requests, args.seconds, path,
                                                            content_type)
        finally:
            stop(server)
    print(f"serve.rank_dense={args.rank_dense}\n")
    print("| candidates | clients | request | p50 ms | p99 ms | candidates/s | ÷ mlflow's |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    error = 0.0
    for size in args.sizes:
        for clients in args.clients:
            latencies, wall, _ = results["mlflow /invocations, rows expanded", size, clients]
            base = len(latencies) * size / wall
            for name in cells:
                latencies, wall, _ = results[name, size, clients]
                ms = np.array(latencies) * 1e3
                rate = len(ms) * size / wall
                print(f"| {size:,} | {clients} | {name} | {np.percentile(ms, 50):.2f} | {np.percentile(ms, 99):.2f} | "
                      f"{rate:,.0f} | {'' if name.startswith('mlflow') else f'{rate / base:.1f}×'} |", flush=True)
        print(f"| {size:,} | – | the model's forward pass alone (pre-encoded, {args.threads} thread(s), fp32) | "
              f"{forward_bound(Path(args.model), bodies[size][0][2], args.threads):.2f} | | | |", flush=True)
        answers = {name: results[name, size, args.clients[0]][2] for name in cells}
        full = answers["mlflow /invocations, rows expanded"]
        for name, got in answers.items():
            for j in set(got) & set(full):
                diff = float(np.abs(probabilities(got[j]) - probabilities(full[j])).max())
                if name.startswith("ctr /rank"):
                    error = max(error, diff)
                elif diff > 1e-6:
                    raise SystemExit(f"{name} disagrees with MLflow on request {j} of {size} candidates: {diff:.2e}")
    if args.rank_dense == "fp32" and error > 1e-5:
        raise SystemExit(f"/rank in fp32 is {error:.2e} from the expanded rows' probabilities (expected ≤ 1e-5)")
    print(f"\nlargest |/rank − expanded rows| over the answers compared (the first clients' cells): {error:.2e}")


if __name__ == "__main__":
    main()
