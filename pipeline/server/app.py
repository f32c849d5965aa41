"""The scoring server as an ASGI app (run by uvicorn: :mod:`pipeline.commands.serve`), speaking MLflow's
scoring protocol so that any MLflow client keeps working:

    POST /rank          one context and N candidates (:mod:`.requests`, :mod:`pipeline.scoring.ranking`) → the
                        candidates' probabilities as /invocations answers; the ranking requests waiting scored
                        together in the scoring thread (:func:`.batcher.rank_batch`)
    POST /invocations   a body of :mod:`.requests` → 200 {"predictions": [{"probability": p}, ...]}
                        (header X-Model-Version: the version that scored it);
                        400 {"error_code": "BAD_REQUEST", "message": ...} naming the column or field;
                        503 + Retry-After when the worker holds its bound of requests (:mod:`.admission`);
                        413 for a body larger than that bound (no retry helps); a client that disconnects
                        before its body arrived gets nothing scored
    GET  /ping, /health 200 once a model is loaded
    GET  /version       {"model": <version: the model's source as given, runs:/ and models:/ pinned>,
                         "mlflow": <MLflow's version>}
    GET  /metrics       Prometheus text (:mod:`.metrics`)

One app per worker process. At start it loads the version published in the serve directory
(:mod:`.versions`); a task polls that file and loads a new version beside the one serving, then swaps
(:meth:`pipeline.server.batcher.Batcher.swap`): requests in flight finish on the old one; the worker
names the versions it uses in the serve directory, so that old ones are deleted only once unused
(:mod:`.old_versions`). A bad body never reaches the model; a bug while scoring answers 500 and the
worker goes on. The event loop only moves bytes: loading, parsing, scoring and encoding answers run
in threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch

from pipeline.runtime.library_noise import quiet_libraries
from pipeline.server import metrics
from pipeline.server.admission import RETRY_AFTER_S, Admission
from pipeline.server.batcher import Batcher, Served
from pipeline.server.old_versions import forget_use, record_use
from pipeline.server.requests import RequestError
from pipeline.server.settings import ServeSettings
from pipeline.server.versions import Version, published, slug
from pipeline.scoring.ranking import Ranker
from pipeline.scoring.scorer import Scorer

log = logging.getLogger(__name__)
SETTINGS_ENV = "CTR_SERVE_SETTINGS"  # the workers' settings (JSON of ServeSettings), set by ``ctr serve``


def fused_dir(version: Version, workdir: Path) -> Path:
    """Where a version's fused table buffers go (a folder replaced in place gets new ones)."""
    written = (Path(version.folder) / "model.json").stat().st_mtime_ns
    return workdir / "fused" / slug(f"{version.folder}:{written}")


def load(version: Version, workdir: Path, small_batch_rows: int, rank_dense: str = "fp32") -> Served:
    """A version's scorer: float tables read through the model folder's mapped files, quantized ones —
    and the fused copy of float ones for model calls of at most ``small_batch_rows`` rows — through a
    buffer file in the serve directory (:func:`pipeline.model_folder.quantize.share_fused_buffers`): one copy
    in the page cache for all workers. ``rank_dense``: the precision of ranking requests' hidden-layer GEMMs."""
    shared = fused_dir(version, workdir)
    scorer = Scorer(version.folder, shared_dir=shared, small_batch_rows=small_batch_rows)
    return Served(version, scorer, shared, Ranker(scorer, rank_dense))


class ScoringApp:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.workdir = Path(settings.dir)
        self.batcher: Batcher | None = None
        self.admission = Admission(settings.max_queued_bytes, settings.max_queued_requests)
        self._stamp = 0
        self._poller: asyncio.Task | None = None
        self._about: dict[str, str] = {}

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._start()
                except Exception as e:  # noqa: BLE001 — uvicorn reports it and exits
                    await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._poller is not None:
                    self._poller.cancel()
                if self.batcher is not None:
                    await self.batcher.stop()
                forget_use(self.workdir)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        torch.set_num_threads(self.settings.threads)
        loop = asyncio.get_running_loop()
        self._about["mlflow"] = await loop.run_in_executor(None, package_version, "mlflow")
        version, self._stamp = published(self.workdir)
        served = await loop.run_in_executor(None, self._load, version)
        await loop.run_in_executor(None, self._use, served)
        self.batcher = Batcher(served, self.settings.max_batch_rows, self.settings.max_wait_ms)
        self.batcher.start()
        self._poller = asyncio.get_running_loop().create_task(self._poll())
        log.info("worker %d serves %s", os.getpid(), version.label)

    async def _poll(self) -> None:
        """Load a newly published version beside the serving one, then swap."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                version, stamp = published(self.workdir)
            except (OSError, ValueError, TypeError):  # being replaced: the next poll reads it
                continue
            if stamp == self._stamp or version == self.batcher.served.version:
                self._stamp = stamp
                continue
            try:
                served = await loop.run_in_executor(None, self._load, version, self.batcher.served)
            except Exception:  # noqa: BLE001 — a version that does not load: keep serving the old one
                log.exception("worker %d: cannot load %s; still serving %s", os.getpid(), version.label,
                              self.batcher.served.version.label)
                self._stamp = stamp
                await loop.run_in_executor(None, self._use, self.batcher.served)
                continue
            self._stamp = stamp
            self.batcher.swap(served)
            await loop.run_in_executor(None, self._use, served)
            metrics.SWAPS.inc()
            log.warning("worker %d now serves %s", os.getpid(), version.label)

    def _load(self, version: Version, serving: Served | None = None) -> Served:
        """Load ``version``, named as in use (beside the one ``serving``) before any of its files is read."""
        record_use(self.workdir, [version.folder, *([serving.version.folder] if serving else [])],
                   [fused_dir(version, self.workdir), *([serving.fused_dir] if serving else [])],
                   serving.version.folder if serving else None)
        return load(version, self.workdir, self.settings.small_batch_rows, self.settings.rank_dtype)

    def _use(self, served: Served) -> None:
        record_use(self.workdir, [served.version.folder], [served.fused_dir], served.version.folder)

    async def _http(self, scope: dict, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        if path in ("/invocations", "/rank") and method == "POST":
            await self._invocations(scope, receive, send, rank=path == "/rank")
        elif path in ("/ping", "/health") and method == "GET":
            ready = self.batcher is not None
            await _reply(send, 200 if ready else 503, b"\n", b"text/plain")
        elif path == "/version" and method == "GET":
            served = self.batcher.served.version
            await _json(send, 200, {"model": served.label, **self._about})
        elif path == "/metrics" and method == "GET":
            await _reply(send, 200, metrics.exposition(), metrics.CONTENT_TYPE.encode())
        else:
            await _json(send, 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"{method} {path}: no such endpoint "
                                    f"(POST /invocations, /rank; GET /ping, /health, /version, /metrics)"})

    async def _invocations(self, scope: dict, receive, send, rank: bool = False) -> None:
        """A scoring request (``rank``: a ranking one, :mod:`pipeline.scoring.ranking`): its body held within the
        worker's bounds, then scored."""
        t0 = time.perf_counter()
        if not self.admission.enter():
            if await _drain(receive):
                await self._shed(send, t0)
            return
        held, bound = 0, self.settings.max_queued_bytes
        try:
            declared = _header(scope, b"content-length")
            if declared.isdigit() and int(declared) > bound:  # can never fit: no retry helps
                if await _drain(receive):
                    await self._too_large(send, t0)
                return
            if declared.isdigit():
                held = int(declared)
                if not self.admission.take(held):
                    held = 0
                    if await _drain(receive):
                        await self._shed(send, t0)
                    return
            body, held = await self._body(receive, held)
            if body is _GONE:  # the client went before its body arrived: nothing to score, no one to answer
                metrics.observe(499, time.perf_counter() - t0)
                return
            if body is _SHED:
                return await self._shed(send, t0)
            if body is _TOO_LARGE:
                return await self._too_large(send, t0)
            status, answer, headers = await self._score(body, _header(scope, b"content-type"), rank)
            # counted before the answer leaves: a client that reads /metrics right after its answer sees it counted
            metrics.observe(status, time.perf_counter() - t0)
            await _reply(send, status, answer, b"application/json", headers)
        finally:
            self.admission.leave(held)

    async def _body(self, receive, held: int) -> tuple[bytes | object, int]:
        """The request's body (_TOO_LARGE: over the worker's bound, _SHED: over what it has left now, _GONE: the
        client disconnected before the end) and the bytes now held for it (``held`` already taken from its
        Content-Length)."""
        chunks, size, bound = [], 0, self.settings.max_queued_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _GONE, held
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > bound:
                return (_TOO_LARGE if not more or await _drain(receive) else _GONE), held
            if size > held:
                if not self.admission.take(size - held):
                    return (_SHED if not more or await _drain(receive) else _GONE), held
                held = size
            chunks.append(chunk)
            if not more:
                return b"".join(chunks), held

    async def _too_large(self, send, t0: float) -> None:
        """413: a body larger than the worker may ever hold (serve.max_queued_mb); retrying would not help."""
        metrics.observe(413, time.perf_counter() - t0)
        await _reply(send, 413, _error("REQUEST_TOO_LARGE", f"the request body is larger than a worker holds "
                                       f"(serve.max_queued_mb={self.settings.max_queued_mb:g} MiB): split it"),
                     b"application/json")

    async def _shed(self, send, t0: float) -> None:
        """503 with Retry-After (the body was read and dropped: a client that sends its whole body before it
        reads then sees the answer, not a reset connection)."""
        metrics.SHED.inc()
        metrics.observe(503, time.perf_counter() - t0)
        await _reply(send, 503, _error("TEMPORARILY_UNAVAILABLE", "the server holds as many requests as it may "
                                       "(serve.max_queued_mb, serve.max_queued_requests); retry later"),
                     b"application/json", [(b"retry-after", str(RETRY_AFTER_S).encode())])

    async def _score(self, body: bytes, content_type: str, rank: bool) -> tuple[int, bytes, list]:
        try:
            answer, label = await (self.batcher.rank if rank else self.batcher.score)(body, content_type)
        except RequestError as e:
            return 400, _error("BAD_REQUEST", str(e)), []
        except Exception as e:  # noqa: BLE001 — logged by the batcher
            return 500, _error("INTERNAL_ERROR", f"{type(e).__name__}: {e}"), []
        return 200, answer, [(b"x-model-version", label.encode())]


_SHED, _TOO_LARGE, _GONE = object(), object(), object()


async def _drain(receive) -> bool:
    """Read the rest of a request's body, keeping nothing; False if the client disconnected first."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        if not message.get("more_body", False):
            return True


def _error(code: str, message: str) -> bytes:
    return json.dumps({"error_code": code, "message": message}).encode()


def _header(scope: dict, name: bytes) -> str:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), "")


async def _json(send, status: int, answer: Any, headers: list | None = None) -> None:
    await _reply(send, status, json.dumps(answer).encode(), b"application/json", headers)


async def _reply(send, status: int, body: bytes, content_type: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def create_app() -> ScoringApp:
    """The app of one worker, from the settings ``ctr serve`` put in the environment."""
    quiet_libraries()  # a worker is a fresh process
    return ScoringApp(ServeSettings(**json.loads(os.environ[SETTINGS_ENV])))
