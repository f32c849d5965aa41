"""Dynamic batching: concurrent requests scored in one model call, the answers split back.

Requests wait in a queue. One scoring thread takes, each time it is free, the waiting requests (up to
16 MiB of bodies; after
waiting up to ``max_wait_ms`` for more when only one has come; 0, the default: no wait — under load the
requests that arrive while a batch is scored form the next one). It parses the bodies
(:mod:`.requests`), encodes the batch's raw columns in one pass, runs the model on at most
``max_batch_rows`` rows a call and gives each request its rows' probabilities. A request that cannot
be read or encoded (bad JSON, a missing column, a word in a numeric column) fails alone: the batch is
then encoded request by request and the others are scored. The whole batch is scored by one model
version, read once per batch, so a hot swap (:meth:`Batcher.swap`) never mixes versions inside an
answer.

Ranking requests (``POST /rank``) queue apart and are taken the same way: those waiting when the scoring thread is
free score together, the requests whose contexts give the same columns in one model call
(:meth:`pipeline.scoring.ranking.Ranker.probabilities_of`), each failing alone.

The event loop only moves HTTP bytes; parsing, encoding, the model and the answers' JSON run in the
scoring thread, one batch after another, so the two threads do not take the GIL from each other mid-request (PyTorch
releases it while the model computes, so requests keep arriving meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import BundleError, MissingColumnsError
from pipeline.server import metrics
from pipeline.server.requests import Parsed, RequestError, encode_lines, parse, parse_rank
from pipeline.server.versions import Version
from pipeline.scoring.ranking import Ranker
from pipeline.scoring.scorer import Scorer

log = logging.getLogger(__name__)
MAX_BATCH_REQUESTS = 1024     # requests taken at once (their rows go to the model max_batch_rows at a time)
MAX_BATCH_BYTES = 16 << 20    # and bytes of their bodies


@dataclass
class Served:
    """A loaded model version."""

    version: Version
    scorer: Scorer
    fused_dir: Path  # where its fused table buffers are (if it has any)
    ranker: Ranker = field(repr=False)  # ranking requests against the same model


@dataclass
class _Waiting:
    body: bytes
    content_type: str
    future: asyncio.Future = field(repr=False)


class Batcher:
    def __init__(self, served: Served, max_batch_rows: int, max_wait_ms: float) -> None:
        self.served = served
        self.max_rows, self.max_wait = max_batch_rows, max_wait_ms / 1000
        self.queue: asyncio.Queue[_Waiting] = asyncio.Queue()
        self.rank_queue: asyncio.Queue[_Waiting] = asyncio.Queue()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="score")
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(self.queue, answer_batch)),
                       loop.create_task(self._run(self.rank_queue, rank_batch))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.pool.shutdown(wait=True)

    def swap(self, served: Served) -> None:
        """Answer with ``served`` from the next batch on."""
        self.served = served

    async def score(self, body: bytes, content_type: str) -> tuple[bytes, str]:
        """The request's answer (JSON of its probabilities) and the version that scored them
        (:class:`RequestError`: a bad body)."""
        return await self._answer(self.queue, body, content_type)

    async def rank(self, body: bytes, content_type: str) -> tuple[bytes, str]:
        """A ranking request's answer and the version that scored it (:class:`RequestError`: a bad body)."""
        return await self._answer(self.rank_queue, body, content_type)

    async def _answer(self, queue: asyncio.Queue[_Waiting], body: bytes, content_type: str) -> tuple[bytes, str]:
        future = asyncio.get_running_loop().create_future()
        await queue.put(_Waiting(body, content_type, future))
        return await future

    async def _next_batch(self, queue: asyncio.Queue[_Waiting]) -> list[_Waiting]:
        batch = [await queue.get()]
        if self.max_wait > 0 and queue.empty():
            await asyncio.sleep(self.max_wait)
        size = len(batch[0].body)
        while not queue.empty() and len(batch) < MAX_BATCH_REQUESTS and size < MAX_BATCH_BYTES:
            batch.append(queue.get_nowait())
            size += len(batch[-1].body)
        return batch

    async def _run(self, queue: asyncio.Queue[_Waiting],
                   answer: Callable[[Served, list[tuple[bytes, str]], int], tuple[list[bytes | Exception], str]]
                   ) -> None:
        """Batches from ``queue``, answered by ``answer`` in the scoring thread."""
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch(queue)
            try:
                outcomes, label = await loop.run_in_executor(self.pool, answer, self.served,
                                                             [(w.body, w.content_type) for w in batch], self.max_rows)
            except Exception as e:  # noqa: BLE001 — a bug: every request of the batch answers 500, the server lives
                log.exception("scoring a batch of %d requests failed", len(batch))
                outcomes, label = [e] * len(batch), ""
            for waiting, outcome in zip(batch, outcomes):
                if waiting.future.done():  # the client went away
                    continue
                if isinstance(outcome, BaseException):
                    waiting.future.set_exception(outcome)
                else:
                    waiting.future.set_result((outcome, label))


def answer_batch(served: Served, bodies: list[tuple[bytes, str]], max_rows: int
                 ) -> tuple[list[bytes | Exception], str]:
    """:func:`score_batch`, each request's probabilities as the JSON of its answer."""
    outcomes, label = score_batch(served, bodies, max_rows)
    return [o if isinstance(o, Exception) else answer_json(o) for o in outcomes], label


def answer_json(probability: np.ndarray) -> bytes:
    """MLflow's answer: ``{"predictions": [{"probability": p}, ...]}``."""
    return json.dumps({"predictions": [{"probability": p} for p in probability.tolist()]}).encode()


def rank_batch(served: Served, bodies: list[tuple[bytes, str]], max_rows: int
               ) -> tuple[list[bytes | Exception], str]:
    """The JSON answers of ``POST /rank`` bodies scored together (:class:`RequestError` for a bad one, the exception
    of a bug for a request that met one), all by ``served``, at most ``max_rows`` candidates a model call."""
    outcomes: list[bytes | Exception | None] = [None] * len(bodies)
    parsed = []
    for i, (body, content_type) in enumerate(bodies):
        try:
            parsed.append((i, parse_rank(body, content_type)))
        except RequestError as e:
            outcomes[i] = e
    scored = served.ranker.probabilities_of([(r.context, r.candidates, r.rows) for _, r in parsed], max_rows)
    for (i, _), result in zip(parsed, scored):
        if isinstance(result, (BundleError, MissingColumnsError)):
            outcomes[i] = RequestError(str(result))
        elif isinstance(result, Exception):  # a bug met by this request: a 500 for it alone, the server lives
            log.error("ranking a request failed", exc_info=result)
            outcomes[i] = result
        else:
            outcomes[i] = answer_json(result)
    return outcomes, served.version.label


def score_batch(served: Served, bodies: list[tuple[bytes, str]], max_rows: int
                ) -> tuple[list[np.ndarray | Exception], str]:
    """Each request's probabilities (or the error that refused it), all scored by ``served``, at most
    ``max_rows`` rows a model call."""
    scorer = served.scorer
    outcome: list[np.ndarray | Exception | None] = [None] * len(bodies)
    requests: list[Parsed | None] = [None] * len(bodies)
    for i, (body, content_type) in enumerate(bodies):
        try:
            requests[i] = parse(body, content_type)
        except RequestError as e:
            outcome[i] = e
    parts: list[tuple[list[int], SplitArrays]] = []
    by_columns = [i for i, r in enumerate(requests) if r is not None and r.columns is not None and r.rows > 0]
    if by_columns:
        try:
            parts.append((by_columns, scorer.encode_columns(_merged(scorer, [requests[i] for i in by_columns]),
                                                            sum(requests[i].rows for i in by_columns))))
        except Exception:  # noqa: BLE001 — someone's columns are bad (or met a bug): find whose, each fails alone
            for i in by_columns:
                try:
                    parts.append(([i], scorer.encode_columns(requests[i].columns, requests[i].rows)))
                except (BundleError, MissingColumnsError, KeyError) as e:
                    outcome[i] = RequestError(str(e))
                except Exception as e:  # noqa: BLE001 — a bug met by this request's values: a 500 for it alone
                    log.exception("encoding one request failed")
                    outcome[i] = e
    for i, r in enumerate(requests):
        if r is not None and r.lines is not None:
            try:
                parts.append(([i], encode_lines(scorer, r.lines)))
            except RequestError as e:
                outcome[i] = e
        elif r is not None and r.rows == 0:
            outcome[i] = np.zeros(0, np.float32)
    if parts:
        p = scorer.score(SplitArrays.concat([a for _, a in parts]), batch_size=max_rows)
        for start in range(0, len(p), max_rows):
            metrics.observe_batch(min(max_rows, len(p) - start))
        start = 0
        for members, arrays in parts:
            for i in members:
                n = len(arrays) if requests[i].lines is not None else requests[i].rows
                outcome[i], start = p[start:start + n], start + n
    return outcome, served.version.label


def _merged(scorer: Scorer, requests: list[Parsed]) -> dict[str, list]:
    """The columns the model reads, the requests' values one after another (KeyError: one lacks a column)."""
    if len(requests) == 1:
        return requests[0].columns
    return {c: [v for r in requests for v in r.columns[c]] for c in scorer.reading(label=False).read_columns}
