"""The server's Prometheus metrics (``GET /metrics``, text exposition format), with ``prometheus_client``.

    ctr_serve_requests_total{status}           requests answered, by HTTP status
    ctr_serve_rows_total                       rows scored
    ctr_serve_batch_rows                       histogram: rows per model call (dynamic batching at work)
    ctr_serve_request_seconds                  histogram: time from the request's body read to its answer
    ctr_serve_request_seconds_recent{quantile} p50 / p90 / p99 of the last 2,000 requests (a worker's;
                                               with several workers the highest of theirs)
    ctr_serve_model_swaps_total                model versions switched to since start
    ctr_serve_shed_total                       requests answered 503 at once: the worker held its bound
                                               (:mod:`pipeline.server.admission`; also in requests_total)

With ``serve.workers`` > 1 every worker writes its counts to ``PROMETHEUS_MULTIPROC_DIR`` (set by
``ctr serve`` before the workers start) and ``/metrics``, answered by any worker, sums them.
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, multiprocess)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUANTILES = (0.5, 0.9, 0.99)
WINDOW = 2000

CONTENT_TYPE = CONTENT_TYPE_LATEST
REQUESTS = Counter("ctr_serve_requests_total", "Requests answered, by HTTP status", ["status"])
ROWS = Counter("ctr_serve_rows_total", "Rows scored")
BATCH_ROWS = Histogram("ctr_serve_batch_rows", "Rows per model call", buckets=BATCH_BUCKETS)
LATENCY = Histogram("ctr_serve_request_seconds", "Seconds from a request's body to its answer",
                    buckets=LATENCY_BUCKETS)
RECENT = Gauge("ctr_serve_request_seconds_recent", f"Latency quantiles of the last {WINDOW} requests",
               ["quantile"], multiprocess_mode="max")
SWAPS = Counter("ctr_serve_model_swaps_total", "Model versions switched to since start")
SHED = Counter("ctr_serve_shed_total", "Requests shed with 503: the worker held its bound of requests or bytes")

_recent: deque[float] = deque(maxlen=WINDOW)
_observed = [0]  # requests seen by this worker (the window's length stops at WINDOW; this does not)


def observe(status: int, seconds: float) -> None:
    REQUESTS.labels(str(status)).inc()
    LATENCY.observe(seconds)
    _recent.append(seconds)
    _observed[0] += 1
    if _observed[0] % 100 == 1:  # each worker's quantiles every 100 requests, also for one that answers /metrics
        _update_recent()


def _update_recent() -> None:
    values = np.quantile(np.fromiter(_recent, float), QUANTILES)
    for q, v in zip(QUANTILES, values):
        RECENT.labels(str(q)).set(float(v))


def observe_batch(rows: int) -> None:
    ROWS.inc(rows)
    BATCH_ROWS.observe(rows)


def exposition() -> bytes:
    """The metrics as Prometheus text (summed over the workers' files when there are several)."""
    if _recent:
        _update_recent()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY)
