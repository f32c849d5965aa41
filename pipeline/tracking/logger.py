"""MLflow tracking that a tracking server cannot stop: fail fast at the start, never block training.

* **At the start** (:func:`pipeline.tracking.store.probe`): an ``http(s)`` tracking URI must answer ``GET /health`` within
  ``logger.connect_timeout_s`` (default 5 s), before any data work; otherwise the run stops with
  :class:`pipeline.runtime.errors.TrackingUnavailableError` naming ``logger.tracking_uri`` — or, with
  ``logger.on_unavailable=local``, logs to a local store in the run's output folder and says so.
* **During the run** (:class:`QueuedClient`): once the run exists, every logging call (metrics,
  parameters, artifacts, the final status) goes into a queue that a background thread delivers in
  order, retrying a failed call with exponential backoff (0.5 s doubling up to ``retry_max_s``). A
  server that goes away only delays delivery; training never waits for it.
* **At the end** (:meth:`TrackedMLflowLogger.close`): the queue gets up to ``logger.flush_timeout_s``
  to drain; calls still undelivered are written to ``<output folder>/mlflow_fallback.db`` (a local
  MLflow store, run tagged with the original run id), and the command prints how to replay them:
  ``ctr sync source=<that store> target=<tracking uri>``.

Each HTTP request of the MLflow client is bounded too (:func:`pipeline.tracking.store.bound_http_requests`).
"""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from mlflow.tracking import MlflowClient

from pipeline.tracking.heartbeat import Heartbeat, StaleRunWatch, reopen

FALLBACK_DB = "mlflow_fallback.db"
ORIGINAL_RUN_TAG = "ctr.original_run_id"
ORIGINAL_URI_TAG = "ctr.original_tracking_uri"


Call = tuple[str, tuple, dict]


class QueuedClient:
    """An ``MlflowClient`` whose logging calls are queued and delivered, in order, by a background thread;
    every other attribute is the client's own (synchronous)."""

    QUEUED = frozenset({"log_batch", "log_metric", "log_param", "set_tag", "log_artifact", "log_artifacts",
                        "set_terminated"})

    def __init__(self, client: MlflowClient, retry_max_s: float = 30.0) -> None:
        self._client, self._retry_max_s = client, retry_max_s
        self._queue: collections.deque[Call] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._deliver, name="mlflow-queue", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in self.QUEUED:
            return attr

        def enqueue(*args: Any, **kwargs: Any) -> None:
            with self._cv:
                self._queue.append((name, args, kwargs))
                self._cv.notify()

        return enqueue

    def _deliver(self) -> None:
        delay = 0.5
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                name, args, kwargs = self._queue[0]
            try:
                getattr(self._client, name)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any failure of the server: retry later
                self.last_error = f"{type(e).__name__}: {e}"[:300]
                with self._cv:
                    self._cv.wait(timeout=delay)
                delay = min(2 * delay, self._retry_max_s)
                continue
            delay = 0.5
            with self._cv:
                self._queue.popleft()

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def close(self, timeout_s: float) -> list[Call]:
        """Wait up to ``timeout_s`` for the queue to drain; stop; return the calls not delivered."""
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.1)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=15)  # an HTTP request in flight ends within its own timeout
        with self._cv:
            left = list(self._queue)
            self._queue.clear()
        return left


def write_fallback(calls: list[Call], run_id: str, experiment: str, uri: str, folder: Path) -> tuple[str, str]:
    """Replay undelivered calls into a local store in ``folder``; (its URI, the local run id)."""
    folder.mkdir(parents=True, exist_ok=True)
    local_uri = f"sqlite:///{(folder / FALLBACK_DB).resolve()}"
    client = MlflowClient(local_uri)
    found = client.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found else client.create_experiment(
        experiment, artifact_location=str((folder / "mlflow_fallback_artifacts").resolve()))
    local_run = client.create_run(exp_id, tags={ORIGINAL_RUN_TAG: run_id, ORIGINAL_URI_TAG: uri}).info.run_id
    for name, args, kwargs in calls:
        if "run_id" in kwargs:
            kwargs = {**kwargs, "run_id": local_run}
        else:
            args = (local_run, *args[1:])
        getattr(client, name)(*args, **kwargs)
    return local_uri, local_run


class TrackedMLflowLogger(MLFlowLogger):
    """Lightning's MLflow logger with a probe at the start and a queue during the run (see module doc)."""

    def __init__(self, *args: Any, retry_max_s: float = 30.0, heartbeat_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._retry_max_s, self._heartbeat_s = retry_max_s, heartbeat_s
        self._resumed = kwargs.get("run_id") is not None
        self._status = "FINISHED"
        self._heartbeat: Heartbeat | None = None
        self._stale_watch: StaleRunWatch | None = None

    @property
    def tracking_uri(self) -> str:
        return self._tracking_uri

    def start(self) -> str:
        """Create (or find) the run now, synchronously — a resumed one RUNNING again
        (:mod:`pipeline.tracking.heartbeat`) — start its heartbeat and the watch for the store's runs whose heartbeat
        stopped, then queue every later call; returns the run id."""
        client = self.experiment
        if self._resumed:
            reopen(client, self.run_id)
        self._heartbeat = Heartbeat(client, self.run_id, self._heartbeat_s).start()
        self._stale_watch = StaleRunWatch(client, skip=self.run_id).start()
        self._mlflow_client = QueuedClient(client, self._retry_max_s)
        return self.run_id

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """As Lightning's; but a resumed run keeps the parameters of its first start (MLflow's are immutable, and the
        queue would retry a refused batch until ``logger.flush_timeout_s``): a setting changed since is the tag
        ``resumed/<key>`` with its new value, a new one a parameter."""
        if not self._resumed:
            return super().log_hyperparams(params)
        flat = {k: str(v)[:250] for k, v in _flatten_dict(_convert_params(params)).items()}  # as Lightning sends them
        held = self.experiment.get_run(self.run_id).data.params
        for key, value in flat.items():
            if key in held and held[key] != value:
                self.experiment.set_tag(self.run_id, f"resumed/{key}", value)
        new = {k: v for k, v in flat.items() if k not in held}
        if new:
            super().log_hyperparams(new)

    def finalize(self, status: str = "success") -> None:
        """Remember the status (set when the run is closed): no synchronous call to the server here."""
        if status == "failed":
            self._status = "FAILED"
        elif status == "killed":
            self._status = "KILLED"

    def close(self, timeout_s: float, folder: Path) -> list[str]:
        """Set the final status, deliver what the queue holds within ``timeout_s``, keep the rest locally.
        Returns lines for the user (none when everything was delivered)."""
        client = self._mlflow_client
        if not isinstance(client, QueuedClient):
            return []
        self._heartbeat.stop()
        self._stale_watch.stop()
        client.set_terminated(self.run_id, self._status)
        left = client.close(timeout_s)
        if not left:
            return []
        local_uri, local_run = write_fallback(left, self.run_id, self._experiment_name, self._tracking_uri, folder)
        return [f"MLflow: {len(left)} logging call(s) did not reach {self._tracking_uri} within "
                f"logger.flush_timeout_s={timeout_s:g} (last error: {client.last_error}); they are kept in "
                f"{local_uri} (run {local_run}).",
                f"Replay them later: ctr sync source={local_uri} target={self._tracking_uri}"]
