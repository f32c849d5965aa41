"""Ranking: one context and N candidates scored together (``POST /rank``: :mod:`pipeline.server.requests`), the
context's share computed once.

Every column the model reads comes once: in the context (one value, shared by every candidate) or in the candidates
(one value each). The context's ids are encoded and looked up once (its row and the candidates' in one call of the
collection), its share of the dense layers computed once
(:mod:`modules.models.shared_context`); the candidates' columns are encoded column by column (an Arrow column goes to
the encoder as it is). A declaration with sequence or derived features is scored on the rows expanded (the context's
values repeated), with the same answer. A column given twice or not at all, no candidate, or a value the encoder
cannot read raise :class:`MissingColumnsError` or :class:`BundleError` naming it.

:meth:`Ranker.probabilities_of` scores several requests together: those whose contexts give the same columns share one
lookup of their contexts, one of their candidates and one pass of the dense layers (up to ``max_rows`` candidates a
call), each request still encoded alone so that a bad one fails alone.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from torchrec import KeyedJaggedTensor

from modules.models.shared_context import SharedContext
from pipeline.runtime.errors import MissingColumnsError
from pipeline.scoring.scorer import Scorer

DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16}
Request = tuple[Mapping[str, Any], Mapping[str, Any], int]  # a ranking request: (context, candidates, rows)

class Ranker:
    """Ranking requests against one loaded model (a :class:`Scorer`): its shared-context splits are cut once per
    assignment of the columns to context and candidates, and kept."""

    def __init__(self, scorer: Scorer, dense: str = "fp32") -> None:
        if dense not in DENSE:
            raise ValueError(f"dense={dense!r}: expected one of {sorted(DENSE)}")
        self.scorer = scorer
        self.dense = DENSE[dense]  # the candidates' hidden-layer GEMMs (modules/models/shared_context.py)
        reading = scorer.reading(label=False)
        self.columns = reading.read_columns
        self.features = reading.declared()
        self.fields = list(scorer.model.sparse_arch.fields)
        self.shared_form = not scorer.spec.sequence and not any(f.derive or f.type == "sequence"
                                                                 for f in self.features)
        self._splits: dict[frozenset, SharedContext] = {}

    def check(self, context: Mapping[str, Any], candidates: Mapping[str, Any], rows: int) -> None:
        """Each column the model reads in exactly one of context and candidates, and at least one candidate."""
        both = [c for c in self.columns if c in context and c in candidates]
        if both:
            raise MissingColumnsError(f"column {both[0]!r} is in both context and candidates: give it once "
                                      f"(context: one value for every candidate; candidates: one value each)")
        missing = [c for c in self.columns if c not in context and c not in candidates]
        if missing:
            raise MissingColumnsError(f"the request lacks column{'s' * (len(missing) > 1)} "
                                      f"{', '.join(map(repr, missing))} (the model reads {list(self.columns)}): give "
                                      f"each in context or candidates")
        if rows == 0:
            raise MissingColumnsError("candidates: no candidate to rank (expected at least one value in each column)")

    def probabilities(self, context: Mapping[str, Any], candidates: Mapping[str, Any], rows: int) -> np.ndarray:
        """The click probabilities of ``rows`` candidates (``candidates``: column → their values, a list or an Arrow
        column) sharing ``context`` (column → its value), in their order."""
        (outcome,) = self.probabilities_of([(context, candidates, rows)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def probabilities_of(self, requests: Sequence[Request], max_rows: int = 1 << 30) -> list[np.ndarray | Exception]:
        """Each request's (context, candidates, rows) probabilities, or the error that refuses it; the requests whose
        contexts give the same columns scored together, at most ``max_rows`` candidates a model call (a larger
        request alone)."""
        outcomes: list[np.ndarray | Exception | None] = [None] * len(requests)
        groups: dict[frozenset, list[int]] = {}
        for i, (context, candidates, rows) in enumerate(requests):
            try:
                self.check(context, candidates, rows)
                if self.shared_form:
                    groups.setdefault(frozenset(context), []).append(i)
                else:
                    outcomes[i] = self._expanded(context, candidates, rows)
            except Exception as e:  # noqa: BLE001 — this request's answer (a 4xx, or a 500 for a bug) alone
                outcomes[i] = e
        for members in groups.values():
            chunk: list[int] = []
            candidates = 0
            for i in members:
                if chunk and candidates + requests[i][2] > max_rows:
                    self._score_together(requests, chunk, outcomes)
                    chunk, candidates = [], 0
                chunk.append(i)
                candidates += requests[i][2]
            self._score_together(requests, chunk, outcomes)
        return outcomes

    def _score_together(self, requests: Sequence[Request], members: list[int],
                        outcomes: list[np.ndarray | Exception | None]) -> None:
        """The requests ``members`` (contexts with the same columns) in one model call; each encoded alone."""
        scorer = self.scorer
        in_context = [f for f in self.features if f.source in requests[members[0]][0]]
        per_candidate = [f for f in self.features if f.source not in requests[members[0]][0]]
        encoded = []
        for i in members:
            context, candidates, rows = requests[i]
            try:
                encoded.append((i, *scorer.encode_features({c: [v] for c, v in context.items()}, 1, in_context),
                                *scorer.encode_features(candidates, rows, per_candidate)))
            except Exception as e:  # noqa: BLE001 — as in probabilities_of
                outcomes[i] = e
        if not encoded:
            return
        b, rows = len(encoded), [requests[i][2] for i, *_ in encoded]
        n = sum(rows)
        ctx_ids, ctx_numbers, ids, numbers = (np.concatenate([e[k] for e in encoded]) for k in (1, 2, 3, 4))
        owner = None if b == 1 else torch.repeat_interleave(torch.arange(b), torch.tensor(rows))
        with torch.inference_mode():
            ctx, cand = self._sides((in_context, ctx_ids, ctx_numbers, b), (per_candidate, ids, numbers, n))
            p = torch.sigmoid(self._split(in_context).logits(ctx, cand, owner)).numpy()
        for (i, *_), start, count in zip(encoded, np.cumsum([0, *rows[:-1]]), rows):
            outcomes[i] = p[start:start + count]

    def _expanded(self, context: Mapping[str, Any], candidates: Mapping[str, Any], rows: int) -> np.ndarray:
        """The plain path: the context's values repeated for every candidate, scored as full rows."""
        columns = {c: candidates[c] if c in candidates else [context[c]] * rows for c in self.columns}
        columns = {c: v.to_pylist() if isinstance(v, (pa.Array, pa.ChunkedArray)) else v for c, v in columns.items()}
        return self.scorer.score(self.scorer.encode_columns(columns, rows))

    def _split(self, in_context: list) -> SharedContext:
        key = frozenset(f.name for f in in_context)
        if key not in self._splits:
            self._splits[key] = SharedContext(
                self.scorer.model, [self.fields.index(f.name) for f in in_context if f.type == "categorical"],
                [self.scorer.spec.dense.index(f.name) for f in in_context if f.type == "numeric"], self.dense)
        return self._splits[key]

    def _sides(self, *sides: tuple[list, np.ndarray, np.ndarray, int]
               ) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """Each side's (its features, their ids [rows, categorical], numbers [rows, numeric], rows) pooled embeddings
        [rows, F, D] and first-order sums (its features' bags; the other side's empty) and numbers [rows, n_dense]
        (zero on the other side's columns), all sides looked up in one call (one pass over the tables' keys)."""
        scorer = self.scorer
        rows = [r for *_, r in sides]
        total = sum(rows)
        names = [[f.name for f in features if f.type == "categorical"] for features, *_ in sides]
        values, lengths, per_key = [], [], []
        for key in self.fields:  # every categorical feature is on exactly one side (Ranker.check)
            mine = next(i for i, side_names in enumerate(names) if key in side_names)
            values.append(sides[mine][1][:, names[mine].index(key)])
            lengths.append(np.repeat(np.array([int(i == mine) for i in range(len(sides))], np.int32), rows))
            per_key.append(rows[mine])
        kjt = KeyedJaggedTensor(keys=self.fields, values=torch.from_numpy(np.concatenate(values)),
                                lengths=torch.from_numpy(np.concatenate(lengths)), stride=total,
                                length_per_key=per_key, offset_per_key=[0, *np.cumsum(per_key).tolist()])
        small = scorer.small_model or scorer.model
        emb, wide = (small if total <= scorer.small_batch_rows else scorer.model).sparse_arch(kjt)
        dense = np.zeros((total, len(scorer.spec.dense)), np.float32)
        out, start = [], 0
        for (features, _, numbers, _), end in zip(sides, np.cumsum(rows)):
            dense[start:end, [scorer.spec.dense.index(f.name) for f in features if f.type == "numeric"]] = numbers
            out.append((emb[start:end], None if wide is None else wide[start:end], torch.from_numpy(dense[start:end])))
            start = end
        return out
