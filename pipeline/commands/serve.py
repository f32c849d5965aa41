"""``ctr serve``: an HTTP scoring server for a trained model (:mod:`pipeline.server`).

    ctr serve model=<model folder | checkpoint | runs:/<run id>/model | models:/<name>/<version>> \
        [serve.port=5000] [serve.workers=2] [serve.watch=models:/<name>] ...

The model is made a local model folder once (downloaded or exported), published to the workers, and
served by ``serve.workers`` uvicorn processes, which map its tables read-only. With ``serve.watch`` this
process looks for a newer version every ``serve.watch_interval_s`` and publishes it; the workers load
it beside the serving one and switch when it is ready. SIGTERM / Ctrl-C: the workers finish the
requests in flight, then exit; without ``serve.dir`` the temporary folder (the downloaded model, the fused table
copies) is removed, also when the signal comes while the model is being prepared.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import MISSING, DictConfig

from pipeline.commands.args import command_args, exit_on_user_error
from pipeline.server.settings import ServeSettings
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path

if TYPE_CHECKING:
    from pipeline.server.versions import Version

log = logging.getLogger("ctr.serve")


@dataclass
class ServeArgs:
    """``conf/serving/serve.yaml``."""

    model: str = MISSING
    tracking_uri: str = ""
    serve: ServeSettings = MISSING  # every key from conf/serving/serve.yaml


def _watch(args: ServeArgs, workdir: Path, current: Version, stop: threading.Event) -> None:
    """Publish each newer version of ``serve.watch`` (a version that fails to prepare is logged and skipped);
    after each look, delete the versions older than the current and the previous one that no worker uses."""
    from pipeline.server.old_versions import prune
    from pipeline.server.versions import newest, prepare, publish

    seen, kept = current.label, [current.folder]
    while not stop.wait(args.serve.watch_interval_s):
        try:
            spec = newest(args.serve.watch)
            if spec is not None and spec != seen:
                seen = spec
                version = prepare(spec, workdir)
                publish(version, workdir)
                kept = [kept[-1], version.folder]
                log.warning("published %s", spec)
            for path in prune(workdir, kept):
                log.warning("deleted the old version %s", path)
        except Exception:  # noqa: BLE001 — the server keeps its version
            log.exception("serve.watch=%s: cannot prepare its newest version", args.serve.watch)


def run(args: ServeArgs) -> None:
    if args.tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
    os.environ.setdefault("TQDM_DISABLE", "1")  # the raw-row reader's progress bars: not per request
    s = args.serve
    temporary = not s.dir
    workdir = Path(s.dir or tempfile.mkdtemp(prefix="ctr-serve-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # a signal ends the process through Python (uvicorn, once it has shut down gracefully, raises the signal again
    # with these handlers in place): the folder below is removed on the way out
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        _serve(args, workdir)
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)


def _serve(args: ServeArgs, workdir: Path) -> None:
    import uvicorn

    s = args.serve
    if s.workers > 1:  # the workers' metrics, summed by /metrics (set before prometheus_client is imported)
        metrics_dir = workdir / "metrics"
        metrics_dir.mkdir(exist_ok=True)
        for old in metrics_dir.glob("*.db"):
            old.unlink()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    from pipeline.server.app import SETTINGS_ENV
    from pipeline.server.old_versions import prune
    from pipeline.server.versions import prepare, publish

    version = prepare(args.model, workdir)
    publish(version, workdir)
    prune(workdir, [version.folder])  # what an earlier server left in serve.dir and no live worker uses
    os.environ[SETTINGS_ENV] = json.dumps(asdict(replace(s, dir=str(workdir))))  # the workers' settings: these
    stop = threading.Event()
    if s.watch:
        threading.Thread(target=_watch, args=(args, workdir, version, stop), daemon=True, name="watch").start()
    print(f"Serving {version.label} on http://{s.host}:{s.port} ({s.workers} worker(s) × {s.threads} thread(s); "
          f"POST /invocations; GET /ping /version /metrics){'; watching ' + s.watch if s.watch else ''}", flush=True)
    try:
        uvicorn.run("pipeline.server.app:create_app", factory=True, host=s.host, port=s.port, workers=s.workers,
                    log_level="warning", access_log=False, timeout_graceful_shutdown=30,
                    limit_concurrency=s.max_connections)
    finally:
        stop.set()


@hydra.main(version_base="1.3", config_path=config_path("serving"), config_name="serve")
def main(cfg: DictConfig) -> None:
    args = command_args(cfg, ServeArgs)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    exit_on_user_error(lambda: run(args))


def cli() -> None:
    """``ctr serve`` / ``python -m pipeline.commands.serve``."""
    check_overrides(config_path("serving"), "serve")
    main()


if __name__ == "__main__":
    cli()
