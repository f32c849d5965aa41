"""Which MLflow store a run logs to, and its logger.

``logger.tracking_uri`` if it answers within ``logger.connect_timeout_s`` (:func:`probe`); else, with
``logger.on_unavailable=local``, a local store in the run's output folder (replayed later with
``ctr sync``), or :class:`pipeline.runtime.errors.TrackingUnavailableError`. A fresh local store is
created under a file lock, so runs started together on it do not race. Each HTTP request of the MLflow
client is bounded (``MLFLOW_HTTP_REQUEST_TIMEOUT`` 10 s, one retry; set the variables to override), so
an unanswered call costs seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from filelock import FileLock
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.tracking.logger_config import LoggerConfig
from pipeline.runtime.errors import TrackingUnavailableError
from pipeline.runtime.launch import global_rank
from pipeline.runtime.signals import Preempted
from pipeline.tracking.logger import ORIGINAL_RUN_TAG, ORIGINAL_URI_TAG, TrackedMLflowLogger

log = logging.getLogger(__name__)
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def create_local_store(uri: str) -> None:
    """Create a ``sqlite:///`` store's schema under a file lock beside it: runs started together on a
    fresh store would otherwise each create the tables, and all but one fail ("duplicate column")."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        MlflowClient(uri).search_experiments(max_results=1)


def probe(uri: str, timeout_s: float) -> str | None:
    """None if the tracking store at ``uri`` answers (local stores always do); else what was tried."""
    if not is_remote(uri):
        return None
    url = uri.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout_s
    tries, last = 0, ""
    while True:
        tries += 1
        try:
            with urllib.request.urlopen(url, timeout=max(0.5, min(3.0, deadline - time.monotonic()))) as r:
                if r.status == 200:
                    return None
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):  # a server that wants credentials: MLflow's client brings them
                return None
            last = f"HTTP {e.code}"
        except OSError as e:
            last = str(getattr(e, "reason", None) or e)
        if time.monotonic() + 1.0 > deadline:
            return f"GET {url} failed {tries} time(s) in {timeout_s:g} s (last: {last})"
        time.sleep(1.0)


def bound_http_requests() -> None:
    """Seconds, not minutes, per unanswered MLflow request (unless the user set these variables)."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def tracking_uri(cfg: LoggerConfig, output_dir: Path) -> tuple[str, dict[str, str]]:
    """The store to log to, and tags for the run: ``logger.tracking_uri`` if it answers within
    ``logger.connect_timeout_s``; else, with ``logger.on_unavailable=local``, a store in ``output_dir``."""
    bound_http_requests()
    problem = probe(cfg.tracking_uri, cfg.connect_timeout_s)
    if problem is None:
        create_local_store(cfg.tracking_uri)
        return cfg.tracking_uri, {}
    if cfg.on_unavailable == "fail":
        raise TrackingUnavailableError(f"logger.tracking_uri={cfg.tracking_uri}: no MLflow tracking server answered: "
                                       f"{problem}")
    local = f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
    print(f"MLflow: no tracking server at {cfg.tracking_uri} ({problem}); logging to {local} instead "
          f"(logger.on_unavailable=local). Replay later: ctr sync source={local} "
          f"target={cfg.tracking_uri}", flush=True)
    return local, {ORIGINAL_RUN_TAG: "-", ORIGINAL_URI_TAG: cfg.tracking_uri}


def make_logger(cfg: LoggerConfig, run_id: str | None = None, uri: str | None = None,
                tags: dict[str, str] | None = None) -> TrackedMLflowLogger:
    """The MLflow logger (not started); ``run_id`` (from a resumed checkpoint) is continued if the store has it."""
    uri = uri or cfg.tracking_uri
    if run_id is not None:
        try:
            MlflowClient(uri).get_run(run_id)
        except MlflowException:
            log.warning("The checkpoint's MLflow run %s is not in %s (logger.tracking_uri); logging to a new run",
                        run_id, uri)
            run_id = None
    return TrackedMLflowLogger(experiment_name=cfg.experiment_name, run_name=cfg.run_name, tracking_uri=uri,
                               log_model=False, run_id=run_id, tags=tags or None, retry_max_s=cfg.retry_max_s,
                               heartbeat_s=cfg.heartbeat_s)


def start_logger(cfg: LoggerConfig, output_dir: Path, run_id: str | None, tags: dict[str, str]
                 ) -> TrackedMLflowLogger | bool:
    """The started logger of global rank 0 (False on other ranks: creating the client there would race on
    the store's creation). It also watches the store for runs whose heartbeat stopped, marks them FAILED
    and says so (:mod:`pipeline.tracking.heartbeat`)."""
    if global_rank() != 0:
        return False
    uri, fallback_tags = tracking_uri(cfg, output_dir)
    logger = make_logger(cfg, run_id, uri, {**fallback_tags, **tags})
    logger.start()
    return logger


@contextlib.contextmanager
def logging_run(logger: TrackedMLflowLogger | bool, cfg: LoggerConfig, output_dir: Path) -> Iterator[list[str]]:
    """Around a run's work: a preemption marks the MLflow run KILLED, any other error FAILED; at the end
    the run is closed and what did not reach the store is kept locally. The yielded list then holds the
    lines saying so (printed too; empty when everything was delivered)."""
    undelivered: list[str] = []
    try:
        yield undelivered
    except Preempted:
        if logger:
            logger.finalize("killed")
        raise
    except BaseException:
        if logger:
            logger.finalize("failed")
        raise
    finally:
        if logger:
            undelivered += logger.close(cfg.flush_timeout_s, output_dir)
            for line in undelivered:
                print(line, flush=True)
