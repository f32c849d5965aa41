"""The scoring server as an ASGI app (run by uvicorn: :mod:`pipeline.commands.serve`), speaking MLflow's
scoring protocol so that any MLflow client keeps working:

    POST /invocations   a body of :mod:`.requests` → 200 {"predictions": [{"probability": p}, ...]}
                        (header X-Model-Version: the version that scored it);
                        400 {"error_code": "BAD_REQUEST", "message": ...} naming the column or field
    GET  /ping, /health 200 once a model is loaded
    GET  /version       {"model": <version>, "folder": ..., "mlflow": <MLflow's version>}
    GET  /metrics       Prometheus text (:mod:`.metrics`)

One app per worker process. At start it loads the version published in the serve directory
(:mod:`.versions`); a task polls that file and loads a new version beside the one serving, then swaps
(:meth:`pipeline.server.batcher.Batcher.swap`): requests in flight finish on the old one. A bad body
never reaches the model; a bug while scoring answers 500 and the worker goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch

from pipeline.server import metrics
from pipeline.server.batcher import Batcher, Served
from pipeline.server.requests import RequestError
from pipeline.server.versions import Version, published, slug
from pipeline.serving.scorer import Scorer

log = logging.getLogger(__name__)
SETTINGS_ENV = "CTR_SERVE_SETTINGS"  # the workers' settings (JSON of :class:`Settings`), set by ``ctr serve``
MAX_BODY = 256 << 20


@dataclass
class Settings:
    workdir: str
    max_batch_rows: int = 4096
    max_wait_ms: float = 0.0
    threads: int = 1
    poll_s: float = 1.0


def load(version: Version, workdir: Path) -> Served:
    """A version's scorer: float tables read through the model folder's mapped files, quantized ones
    through a buffer file in the serve directory (:func:`pipeline.serving.quantize.share_fused_buffers`):
    one copy in the page cache for all workers."""
    written = (Path(version.folder) / "model.json").stat().st_mtime_ns  # a folder replaced in place: new buffers
    return Served(version, Scorer(version.folder, shared_dir=workdir / "fused" / slug(f"{version.folder}:{written}")))


class ScoringApp:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.workdir = Path(settings.workdir)
        self.batcher: Batcher | None = None
        self._stamp = 0
        self._poller: asyncio.Task | None = None

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
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        torch.set_num_threads(self.settings.threads)
        version, self._stamp = published(self.workdir)
        served = await asyncio.get_running_loop().run_in_executor(None, load, version, self.workdir)
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
                served = await loop.run_in_executor(None, load, version, self.workdir)
            except Exception:  # noqa: BLE001 — a version that does not load: keep serving the old one
                log.exception("worker %d: cannot load %s; still serving %s", os.getpid(), version.label,
                              self.batcher.served.version.label)
                self._stamp = stamp
                continue
            self._stamp = stamp
            self.batcher.swap(served)
            metrics.SWAPS.inc()
            log.warning("worker %d now serves %s", os.getpid(), version.label)

    async def _http(self, scope: dict, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/invocations" and method == "POST":
            await self._invocations(scope, receive, send)
        elif path in ("/ping", "/health") and method == "GET":
            ready = self.batcher is not None
            await _reply(send, 200 if ready else 503, b"\n", b"text/plain")
        elif path == "/version" and method == "GET":
            import mlflow

            served = self.batcher.served.version
            await _json(send, 200, {"model": served.label, "folder": served.folder, "mlflow": mlflow.__version__})
        elif path == "/metrics" and method == "GET":
            await _reply(send, 200, metrics.exposition(), metrics.CONTENT_TYPE.encode())
        else:
            await _json(send, 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"{method} {path}: no such endpoint "
                                    f"(POST /invocations; GET /ping, /health, /version, /metrics)"})

    async def _invocations(self, scope: dict, receive, send) -> None:
        body = await _body(receive)
        t0 = time.perf_counter()
        if body is None:
            status, answer, headers = 413, {"error_code": "BAD_REQUEST",
                                            "message": f"request body over {MAX_BODY >> 20} MiB"}, []
        else:
            status, answer, headers = await self._score(body, _header(scope, b"content-type"))
        await _json(send, status, answer, headers)
        metrics.observe(status, time.perf_counter() - t0)

    async def _score(self, body: bytes, content_type: str) -> tuple[int, Any, list]:
        try:
            probability, label = await self.batcher.score(body, content_type)
        except RequestError as e:
            return 400, {"error_code": "BAD_REQUEST", "message": str(e)}, []
        except Exception as e:  # noqa: BLE001 — logged by the batcher
            return 500, {"error_code": "INTERNAL_ERROR", "message": f"{type(e).__name__}: {e}"}, []
        return 200, {"predictions": [{"probability": p} for p in probability.tolist()]}, \
            [(b"x-model-version", label.encode())]


async def _body(receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= MAX_BODY:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if size <= MAX_BODY else None


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
    return ScoringApp(Settings(**json.loads(os.environ[SETTINGS_ENV])))
