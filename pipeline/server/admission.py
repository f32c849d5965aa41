"""Load shedding: a worker holds at most ``serve.max_queued_mb`` of request bodies and
``serve.max_queued_requests`` requests at once — being read, waiting or being scored. A request past
either bound is answered with 503 and ``Retry-After`` (and counted in ``ctr_serve_shed_total``) as soon as its
``Content-Length`` or the bytes so far say it does not fit now; its body is then read and dropped, so that a client
that sends its whole body before reading sees the answer, not a reset connection. A body larger than
``serve.max_queued_mb`` itself can never fit: 413, naming the bound (:mod:`pipeline.server.app`).

Why bytes and requests rather than rows: a row is known only once its body is parsed, in the scoring
thread; bytes bound the rows (every row costs bytes) and what parsing makes of them (the scoring thread
parses at most 16 MiB of bodies at a time: :data:`pipeline.server.batcher.MAX_BATCH_BYTES`). So a
worker's memory stays under its idle size + ``max_queued_mb`` + what one batch's parse and model call
take, however many clients send (connections past ``serve.max_connections`` get uvicorn's own 503).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
LOG_EVERY_S = 10.0


class Admission:
    """The bodies' bytes and the requests a worker holds (one event loop: no lock needed)."""

    def __init__(self, max_bytes: int, max_requests: int) -> None:
        self.max_bytes, self.max_requests = max_bytes, max_requests
        self.bytes = self.requests = 0
        self._shed_since_log, self._logged = 0, 0.0

    def enter(self) -> bool:
        """Take a request slot (False: none left; the request is shed)."""
        if self.requests >= self.max_requests:
            return self._shed()
        self.requests += 1
        return True

    def take(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more of a body (False: over the bound; nothing taken, the request is shed)."""
        if self.bytes + nbytes > self.max_bytes:
            return self._shed()
        self.bytes += nbytes
        return True

    def leave(self, nbytes: int) -> None:
        """A request answered: its slot and the ``nbytes`` it held are free."""
        self.requests -= 1
        self.bytes -= nbytes

    def _shed(self) -> bool:
        self._shed_since_log += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            log.warning("overloaded: %d request(s) shed with 503 since the last such line (holding %d request(s), "
                        "%.1f MiB; bounds serve.max_queued_requests=%d, serve.max_queued_mb=%g)",
                        self._shed_since_log, self.requests, self.bytes / 2**20, self.max_requests,
                        self.max_bytes / 2**20)
            self._shed_since_log, self._logged = 0, now
        return False
