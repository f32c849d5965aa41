"""Ranking requests (pipeline/scoring/ranking.py, modules/models/shared_context.py): one context and N candidates,
the context's share computed once, against the model on the same rows expanded to full rows (the Scorer that
``ctr predict`` uses), for every model; the JSON and Arrow bodies; the refusals."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from modules.embedding.sparse_arch import FeatureSpec
from modules.models import ModelConfig, build_model
from pipeline.data.dataset import builtin_layout
from pipeline.data.hashing import string_keys
from pipeline.data.store import FIRST_VOCAB_ID
from pipeline.data.vocab_files import write_vocabulary
from pipeline.data.vocab_growth import fresh
from pipeline.model_folder.layout import write_bundle
from pipeline.runtime.errors import BundleError, MissingColumnsError
from pipeline.scoring.ranking import Ranker
from pipeline.scoring.scorer import Scorer
from pipeline.server.requests import ARROW_STREAM, RequestError, parse_rank

N = 300
MODELS = {"deepfm": {}, "wide_deep": {}, "dcn": {"cross_layers": 2}, "dcnv2": {"cross_layers": 2},
          "dcnv2_mixture": {"cross_layers": 2, "low_rank": 4, "num_experts": 2, "wide": True}}


def _values(rng: np.random.Generator, n: int) -> list[str]:
    return [f"{v:04x}" for v in rng.integers(0, 40, n)]


@pytest.fixture(scope="module")
def criteo_folder(tmp_path_factory):
    """The Criteo layout's vocabularies (30 known values a column, the others OOV) and a function making a model
    folder of one of the models, its weights drawn large enough that the scores spread over (0, 1)."""
    tmp = tmp_path_factory.mktemp("rank")
    data = builtin_layout("criteo")
    rng = np.random.default_rng(0)
    vocab_dir = tmp / "vocab"
    vocab_dir.mkdir()
    sizes = {}
    for c in data.categorical:
        keys = np.unique(string_keys(pa.array(_values(rng, 30))))
        write_vocabulary(vocab_dir, c, fresh(keys, np.ones(len(keys), np.int64), 0))
        sizes[c] = len(keys) + FIRST_VOCAB_ID
    spec = FeatureSpec.of_data(data, sizes)
    meta = {"dataset": data.name, "dense": list(data.numeric), "categorical": list(data.categorical), "sequence": [],
            "features": [{"name": f, "type": "categorical", "table": f} for f in data.categorical],
            "transforms": {f: "log1p" for f in data.numeric}, "table_sizes": sizes,
            "preprocess": {"hash_buckets": 1000, "categorical": "vocab"}}

    def make(name: str, **scorer_args) -> Scorer:
        args = dict(MODELS[name])
        cfg = ModelConfig(name=name.split("_mixture")[0], embedding_dim=8, mlp=[32, 16], stack_tables=False, **args)
        torch.manual_seed(1)
        model = build_model(cfg, spec, device=torch.device("cpu"))
        state = {k: torch.randn_like(v) * (0.5 if v.dim() == 2 and "sparse_arch" in k else 0.3)
                 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        folder = tmp / name
        if not folder.exists():
            write_bundle(folder, state, cfg, data, meta, vocab_dir)
        return Scorer(folder, **scorer_args)
    return data, make


def _request(data, rng: np.random.Generator) -> tuple[dict, dict]:
    """Half the columns in the context (7 numeric, 13 categorical), the rest per candidate; some values missing."""
    context = {c: float(rng.integers(0, 50)) for c in data.numeric[:7]}
    context.update({c: _values(rng, 1)[0] for c in data.categorical[:13]})
    context[data.categorical[0]] = None
    candidates = {c: rng.integers(0, 100, N).astype(float).tolist() for c in data.numeric[7:]}
    candidates.update({c: _values(rng, N) for c in data.categorical[13:]})
    candidates[data.numeric[8]][3] = None
    candidates[data.categorical[20]][5] = ""
    return context, candidates


@pytest.mark.parametrize("name", list(MODELS))
def test_ranked_scores_equal_the_model_on_the_expanded_rows(criteo_folder, name):
    data, make = criteo_folder
    scorer = make(name)
    ranker = Ranker(scorer)
    context, candidates = _request(data, np.random.default_rng(1))
    full = {**{c: [v] * N for c, v in context.items()}, **candidates}
    want = scorer.score(scorer.encode_columns(full, N))
    assert want.std() > 0.05, "the weights leave the scores too close together for the comparison to mean much"
    got = ranker.probabilities(context, candidates, N)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # the hidden layers' GEMMs in bf16 (serve.rank_dense=bf16): near, not equal
    half = Ranker(scorer, "bf16").probabilities(context, candidates, N)
    assert 0 < np.abs(half - want).max() < 0.02, np.abs(half - want).max()
    # the same request as a JSON body and as an Arrow stream (the context in the schema's metadata)
    body = json.dumps({"context": context, "candidates": candidates}).encode()
    request = parse_rank(body, "application/json")
    np.testing.assert_array_equal(ranker.probabilities(request.context, request.candidates, request.rows), got)
    table = pa.table(candidates).replace_schema_metadata({"context": json.dumps(context)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=128)  # several record batches
    request = parse_rank(sink.getvalue().to_pybytes(), ARROW_STREAM)
    np.testing.assert_allclose(ranker.probabilities(request.context, request.candidates, request.rows), got,
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [N, 40])
def test_fused_small_batches_rank_as_the_collection_does(criteo_folder, tmp_path, n):
    """As a server worker loads a model (calls of at most 64 rows on FBGEMM's fused kernel): the context's row, and
    40 candidates, go through the fused copy of the tables; the scores are the collection's."""
    data, make = criteo_folder
    context, candidates = _request(data, np.random.default_rng(3))
    candidates = {c: v[:n] for c, v in candidates.items()}
    want = Ranker(make("deepfm")).probabilities(context, candidates, n)
    fused = make("deepfm", small_batch_rows=64, shared_dir=tmp_path / "fused")
    assert fused.small_model is not None
    np.testing.assert_allclose(Ranker(fused).probabilities(context, candidates, n), want, rtol=0, atol=1e-6)


def test_bad_ranking_requests_are_refused_naming_what_is_wrong(criteo_folder):
    data, make = criteo_folder
    ranker = Ranker(make("deepfm"))
    context, candidates = _request(data, np.random.default_rng(2))
    clash = data.categorical[0]
    with pytest.raises(MissingColumnsError, match=f"column '{clash}' is in both context and candidates"):
        ranker.probabilities(context, {**candidates, clash: ["a"] * N}, N)
    lacking = {c: v for c, v in candidates.items() if c != data.categorical[25]}
    with pytest.raises(MissingColumnsError, match=f"lacks column '{data.categorical[25]}'"):
        ranker.probabilities(context, lacking, N)
    with pytest.raises(MissingColumnsError, match="no candidate to rank"):
        ranker.probabilities(context, {c: [] for c in candidates}, 0)
    with pytest.raises(RequestError, match=f"context.{data.numeric[0]}: expected one value shared by every candidate"):
        parse_rank(json.dumps({"context": {**context, data.numeric[0]: [1, 2]}, "candidates": candidates}).encode(), "")
    with pytest.raises(RequestError, match="candidates: columns of different lengths"):
        parse_rank(json.dumps({"context": context, "candidates": {**candidates, data.numeric[7]: [1]}}).encode(), "")
    with pytest.raises(RequestError, match="no 'context' key"):
        sink = pa.BufferOutputStream()
        table = pa.table(candidates)
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        parse_rank(sink.getvalue().to_pybytes(), ARROW_STREAM)


@pytest.mark.parametrize("name", list(MODELS))
def test_requests_ranked_together_score_as_each_alone(criteo_folder, name):
    """Requests taken in one batch (``ctr serve`` scores the ranking requests waiting together): those whose contexts
    give the same columns go through one lookup and one pass of the dense layers, each candidate with its own
    context's terms; another column split goes apart; a request with a word in a numeric column fails alone; a batch
    over ``max_rows`` candidates is cut between requests. Each answer equals the request ranked alone."""
    data, make = criteo_folder
    ranker = Ranker(make(name))
    rng = np.random.default_rng(4)
    requests = []
    for n in (N, 7, 40, 1):
        context, candidates = _request(data, rng)
        requests.append((context, {c: v[:n] for c, v in candidates.items()}, n))
    moved = data.numeric[0]  # a request whose context lacks a column the others' contexts give
    context, candidates = _request(data, rng)
    requests.insert(2, ({c: v for c, v in context.items() if c != moved}, {**candidates, moved: [3.0] * N}, N))
    bad_context, bad = _request(data, rng)
    bad[data.numeric[9]] = ["many"] * N
    requests.insert(1, (bad_context, bad, N))
    alone = [ranker.probabilities(*r) if i != 1 else None for i, r in enumerate(requests)]
    for max_rows in (1 << 30, 50):
        together = ranker.probabilities_of(requests, max_rows)
        assert isinstance(together[1], BundleError) and data.numeric[9] in str(together[1]), together[1]
        for i, (want, got) in enumerate(zip(alone, together)):
            if want is not None:
                # to float rounding, as against the expanded rows: the GEMMs' blocking, hence their sums' order, follows
                # the rows of the call (DCN-v2's cross layers carry it to ~1e-5)
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"request {i}, max_rows {max_rows}")
    # the contexts differ: had a candidate taken another request's context, its score would move
    assert np.abs(ranker.probabilities(requests[0][0], requests[4][1], 40) - alone[4]).max() > 1e-3


def test_a_batch_of_ranking_bodies_answers_each_and_a_bad_body_alone(criteo_folder, tmp_path):
    """The scoring thread's batch of ``POST /rank`` bodies (pipeline/server/batcher.py): a JSON body and an Arrow one
    answered as each request alone, an unreadable body and one naming no candidate refused with a 400 of their own."""
    from pipeline.server.batcher import Served, rank_batch
    from pipeline.server.versions import Version

    data, make = criteo_folder
    scorer = make("deepfm")
    served = Served(Version("v", str(tmp_path)), scorer, tmp_path, Ranker(scorer))
    rng = np.random.default_rng(5)
    (c1, k1), (c2, k2) = _request(data, rng), _request(data, rng)
    table = pa.table(k2).replace_schema_metadata({"context": json.dumps(c2)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    bodies = [(json.dumps({"context": c1, "candidates": k1}).encode(), "application/json"), (b"{", "application/json"),
              (sink.getvalue().to_pybytes(), ARROW_STREAM),
              (json.dumps({"context": c1, "candidates": {c: [] for c in k1}}).encode(), "application/json")]
    outcomes, label = rank_batch(served, bodies, 4096)
    assert label == served.version.label
    for i, (context, candidates) in ((0, (c1, k1)), (2, (c2, k2))):
        got = np.array([p["probability"] for p in json.loads(outcomes[i])["predictions"]])
        np.testing.assert_allclose(got, Ranker(scorer).probabilities(context, candidates, N), rtol=0, atol=1e-5)
    assert isinstance(outcomes[1], RequestError) and isinstance(outcomes[3], RequestError), outcomes[1:]
    assert "no candidate to rank" in str(outcomes[3])
