"""CowClip against an nn.Embedding + explicit per-id clipping + optimizer reference.

The model under test is the real one: SparseArch (one EmbeddingBagCollection: a table per field,
and the first-order weights of all fields in one shared table) under DistributedModelParallel with
FBGEMM's fused optimizers (SGD, Adagrad, row-wise Adagrad) or data-parallel tables with torch Adam,
CowClip attached by ``attach_cowclip``.
The reference keeps full ``nn.Embedding`` tables, computes the gradient of the global-mean loss,
adds 2λw once per id present, clips per id with the formula, and applies the optimizer's update
rule written out here. Global scope: statistics over the global batch; local scope: each rank's
share clipped with its own counts (see modules/optim/cowclip.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modules.optim.cowclip import CowClipConfig, per_id_gradient
from modules.embedding.sparse_arch import STACKED_TABLE, FeatureSpec, SparseArch, wide_row_offsets
from modules.optim.embedding_l2 import DecayRule
from tests.dist_utils import run_workers

SPEC = FeatureSpec((), ("a", "b", "c"), {"a": 6, "b": 9, "c": 40})
WIDE_ROWS = wide_row_offsets(SPEC)
DIM, GLOBAL_BATCH, STEPS = 8, 16, 3
LR = {"sgd": 0.5, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.05}
CFG = CowClipConfig(enabled=True, r=0.05, zeta=1e-3, floor="zeta")
L2 = 0.01


class ClipModel(torch.nn.Module):
    """Embeddings → a fixed nonlinear score, so per-sample gradients differ."""

    def __init__(self, device: torch.device | None = None, spec: FeatureSpec = SPEC, stack: bool = False) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(spec, DIM, init_std=0.3, wide=True, device=device, stack=stack)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        emb, first = self.sparse_arch(features)
        return score(emb, first)


def score(emb: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    proj = torch.linspace(-1, 1, DIM, dtype=emb.dtype)
    return 3.0 * torch.tanh((emb * proj).sum(-1)).sum(1) + (emb.sum(1) ** 2).sum(1) + first


def batches(seed: int = 0, steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = np.stack([rng.integers(0, SPEC.table_sizes[f], GLOBAL_BATCH) ** 1 for f in SPEC.categorical], 1)
        ids[:, 2] = np.minimum(ids[:, 2], rng.integers(0, 40, GLOBAL_BATCH))  # skewed: repeated small ids
        out.append((ids.astype(np.int32), rng.integers(0, 2, GLOBAL_BATCH).astype(np.float32)))
    return out


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ClipModel()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return {k: v.clone() for k, v in model.state_dict().items()}


def row_bucket(table: str, row: int) -> int:
    """An arbitrary frequency-bucket assignment the statistics must follow, row by row."""
    return (7 * row + len(table)) % 6


def row_buckets():
    from modules.optim.cowclip import RowBuckets

    sizes = {**{f"emb_{f}": n for f, n in SPEC.table_sizes.items()}, "wide": sum(SPEC.table_sizes.values())}
    tables = {t: torch.tensor([row_bucket(t, r) for r in range(n)]) for t, n in sizes.items()}
    tables[STACKED_TABLE] = torch.cat([tables[f"emb_{f}"] for f in SPEC.categorical])  # each table's rows, in turn
    return RowBuckets(tables)


def stacked_state(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A per-table state dict in the stacked layout: the emb_<f> tables' rows one after the other."""
    out = {k: v for k, v in weights.items() if ".emb_" not in k}
    out[f"sparse_arch.ebc.embedding_bags.{STACKED_TABLE}.weight"] = \
        torch.cat([weights[f"sparse_arch.ebc.embedding_bags.emb_{f}.weight"] for f in SPEC.categorical])
    return out


class Reference:
    """Full tables, explicit per-id L2 + clipping, explicit optimizer update rules."""

    def __init__(self, weights: dict[str, torch.Tensor], opt: str, cfg: CowClipConfig, world: int, scope: str,
                 l2_scope: str = "batch"):
        self.w = {k.split(".")[-2]: v.clone().double() for k, v in weights.items()}
        self.state = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.state2 = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.opt, self.cfg, self.world, self.scope, self.t = opt, cfg, world, scope, 0
        self.l2_scope = l2_scope  # "all": every row gets 2λw each step, absent rows count 1 in the threshold
        self.clipped = self.unclipped = 0
        self.bucket_seen, self.bucket_clipped = np.zeros(6, np.int64), np.zeros(6, np.int64)

    def _grads(self, ids: np.ndarray, labels: np.ndarray, rows: slice) -> dict[str, torch.Tensor]:
        w = {k: v.clone().requires_grad_(True) for k, v in self.w.items()}
        idx = torch.from_numpy(ids.astype(np.int64))
        emb = torch.stack([w[f"emb_{f}"][idx[:, j]] for j, f in enumerate(SPEC.categorical)], 1)
        first = sum(w["wide"][idx[:, j] + WIDE_ROWS[f], 0] for j, f in enumerate(SPEC.categorical))
        logits = score(emb, first)
        y = torch.from_numpy(labels).double()
        per_sample = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
        (per_sample[rows].sum() / len(labels)).backward()  # this share of the global-mean loss
        return {k: v.grad for k, v in w.items()}

    def _clip(self, table: str, grad: torch.Tensor, ids: np.ndarray, l2_share: float, clip: bool) -> torch.Tensor:
        counts = np.bincount(ids, minlength=grad.shape[0])
        out = torch.zeros_like(grad)
        w = self.w[table]
        for k in range(len(counts)) if self.l2_scope == "all" else np.nonzero(counts)[0]:
            g = grad[k] + 2 * L2 * l2_share * w[k]
            threshold = max(counts[k], 1) * max(self.cfg.r * float(w[k].norm()), self.cfg.zeta)
            n = float(g.norm())
            if not clip:
                pass
            elif n > threshold:
                self.clipped += counts[k] > 0
                self.bucket_clipped[row_bucket(table, k)] += counts[k] > 0
                g = g * threshold / n
            else:
                self.unclipped += counts[k] > 0
            if clip:
                self.bucket_seen[row_bucket(table, k)] += counts[k] > 0
            out[k] = g
        return out

    def step(self, ids: np.ndarray, labels: np.ndarray) -> None:
        parts = [slice(None)] if self.scope == "global" else \
            [slice(r * len(labels) // self.world, (r + 1) * len(labels) // self.world) for r in range(self.world)]
        total = {k: torch.zeros_like(v) for k, v in self.w.items()}
        for rows in parts:
            grads = self._grads(ids, labels, rows)
            for j, f in enumerate(SPEC.categorical):
                total[f"emb_{f}"] += self._clip(f"emb_{f}", grads[f"emb_{f}"], ids[rows, j], 1.0 / len(parts), True)
            # first-order weights (each field's rows of the shared table): the L2 term, no clipping
            wide_ids = np.concatenate([ids[rows, j] + WIDE_ROWS[f] for j, f in enumerate(SPEC.categorical)])
            total["wide"] += self._clip("wide", grads["wide"], wide_ids, 1.0 / len(parts), False)
        self.t += 1
        for k, g in total.items():
            self._update(k, g)

    def _update(self, k: str, g: torch.Tensor) -> None:
        lr, w, s, s2 = LR[self.opt], self.w[k], self.state[k], self.state2[k]
        if self.opt == "sgd":
            w -= lr * g
        elif self.opt == "adagrad":
            s += g * g
            w -= lr * g / (s.sqrt() + 1e-8)
        elif self.opt == "rowwise_adagrad":
            s += (g * g).mean(dim=1, keepdim=True)
            w -= lr * g / (s.sqrt() + 1e-8)
        else:  # adam
            s.mul_(0.9).add_(0.1 * g)
            s2.mul_(0.999).add_(0.001 * g * g)
            mhat, vhat = s / (1 - 0.9 ** self.t), s2 / (1 - 0.999 ** self.t)
            w -= lr * mhat / (vhat.sqrt() + 1e-8)


def _worker(rank: int, world: int, optimizers: tuple[str, ...], sharding_type: str, scope: str,
            l2_scope: str = "batch", steps: int = STEPS, stack: bool = False) -> None:
    for opt in optimizers:
        _check(rank, world, opt, sharding_type, scope, l2_scope, steps, stack)


def _check(rank: int, world: int, opt: str, sharding_type: str, scope: str, l2_scope: str = "batch",
           steps: int = STEPS, stack: bool = False) -> None:
    from modules.optim.cowclip_hooks import attach_cowclip
    from modules.optim.optimizers import OptimizerSpec, build_optimizer, replicated_parameters
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec
    from pipeline.data.batches import make_batch
    from pipeline.data.store import SplitArrays

    weights = initial_weights()
    cfg = CowClipConfig(**{**CFG.__dict__, "scope": scope})
    net = ClipModel(device=torch.device("meta"), stack=stack)
    spec = OptimizerSpec(opt, LR[opt])
    topology = TopologySpec(compute_device="cpu", sharding_types=[sharding_type])
    dmp, _ = shard_model(net, spec, topology, torch.device("cpu"))
    dmp.load_state_dict(stacked_state(weights) if stack else weights)
    hooks = attach_cowclip(dmp, cfg, L2, l2_scope, DecayRule(opt, L2), row_buckets())
    stats = hooks.stats
    dense_kernel = [p for _, p in replicated_parameters(dmp)]
    optimizer = build_optimizer(spec, dense_kernel) if dense_kernel else None
    # tables not hooked on the shards (data-parallel Adam) are clipped per rank: the local reference —
    # except with the every-row L2 term, whose dense version works on the all-reduced gradient
    exact = hooks.global_lookups or hooks.every_row_l2 is not None
    reference = Reference(weights, opt, cfg, world, "global" if exact else "local", l2_scope)
    b = GLOBAL_BATCH // world
    for step, (ids, labels) in enumerate(batches(steps=steps)):
        rows = np.arange(rank * b, (rank + 1) * b)
        batch = make_batch(SplitArrays(labels.astype(np.int8), np.zeros((len(labels), 0), np.float32), ids),
                           rows, list(SPEC.categorical))
        if hooks.every_row_l2 is not None:
            hooks.every_row_l2.begin_step(step, LR[opt])
        loss = F.binary_cross_entropy_with_logits(dmp(batch.dense_features, batch.sparse_features), batch.labels)
        loss.backward()
        if hooks.every_row_l2 is not None:
            hooks.every_row_l2.after_backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        reference.step(ids, labels)
    if hooks.every_row_l2 is not None:
        hooks.every_row_l2.flush()
    assert reference.clipped > 0 and reference.unclipped > 0, (reference.clipped, reference.unclipped)
    if world == 1:  # the statistics count exactly the reference's clipped ids
        assert (stats.clipped, stats.ids) == (reference.clipped, reference.clipped + reference.unclipped)
        # and per frequency bucket of the rows (global scope: the hooks on the shards and the dense version)
        if reference.scope == "global":
            seen, clipped = stats.take_buckets()
            assert seen.tolist() == reference.bucket_seen.tolist() and \
                clipped.tolist() == reference.bucket_clipped.tolist(), (seen, clipped, reference.bucket_seen)
    if stack:  # the reference's per-table weights in the stacked layout
        reference.w[STACKED_TABLE] = torch.cat([reference.w[f"emb_{f}"] for f in SPEC.categorical])
    for key, value in dmp.state_dict().items():
        want = reference.w[key.split(".")[-2]].float()
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        if shards is None:
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=key)
            continue
        for shard in shards:
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            torch.testing.assert_close(shard.tensor, want[r0:r0 + nr, c0:c0 + nc], rtol=1e-5, atol=1e-6, msg=key)


# One spawn per (world, sharding, scope); each worker checks several optimizers in turn.
@pytest.mark.parametrize("scope", ["global", "local"])
def test_single_process_every_optimizer(scope):
    run_workers(_worker, 1, ("sgd", "adagrad", "rowwise_adagrad", "adam"), "table_wise", scope)


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
@pytest.mark.parametrize("scope", ["global", "local"])
def test_two_ranks(sharding_type, scope):
    run_workers(_worker, 2, ("adagrad", "rowwise_adagrad"), sharding_type, scope)


# model.stack_tables: the emb tables as rows of one table; the same per-table reference, to the same tolerance
@pytest.mark.parametrize("world,sharding_type,scope,optimizers", [
    (1, "table_wise", "global", ("sgd", "adagrad", "rowwise_adagrad", "adam")),
    (1, "table_wise", "local", ("rowwise_adagrad",)),
    (2, "row_wise", "global", ("rowwise_adagrad",)),
])
def test_stacked_tables(world, sharding_type, scope, optimizers):
    run_workers(_worker, world, optimizers, sharding_type, scope, "batch", STEPS, True)


def test_two_ranks_other_optimizers():
    # Adam on CPU means data-parallel tables: CowClip falls back to local scope, checked as such
    run_workers(_worker, 2, ("sgd", "adam"), "table_wise", "global")


# L2 on every row (optim.embedding_l2_scope=all): 30 steps over a 40-row table whose large ids are rare, so
# rows sit out many steps. Fused tables replay the missed steps lazily; data-parallel ones (Adam) do it densely.
@pytest.mark.parametrize("world,sharding_type,optimizers", [
    (1, "table_wise", ("sgd", "adagrad", "rowwise_adagrad", "adam")),
    (2, "row_wise", ("rowwise_adagrad", "adam")),
])
def test_l2_on_every_row(world, sharding_type, optimizers):
    run_workers(_worker, world, optimizers, sharding_type, "global", "all", 30)


def test_per_id_gradient_formula_in_float64():
    torch.manual_seed(1)
    ids = torch.tensor([3, 1, 3, 3, 7, 1])
    rows = torch.randn(8, 4, dtype=torch.float64)[ids]
    grad = torch.randn(6, 4, dtype=torch.float64)
    for floor in ("zeta", "r_sqrt_d_zeta"):
        cfg = CowClipConfig(enabled=True, r=0.3, zeta=0.5, floor=floor)
        out = per_id_gradient(grad, rows, ids, cfg, l2=0.2)
        for k in (1, 3, 7):
            m = ids == k
            g = grad[m].sum(0) + 2 * 0.2 * rows[m][0]
            f = 0.5 if floor == "zeta" else 0.3 * math.sqrt(4) * 0.5
            thr = int(m.sum()) * max(0.3 * float(rows[m][0].norm()), f)
            want = g * min(1.0, thr / float(g.norm()))
            torch.testing.assert_close(out[m].sum(0), want)


def test_row_buckets_follow_the_vocabulary_counts(tmp_path):
    """Each row's frequency bucket from its value's training count (decades: <10, 10–99, …, ≥10k), OOV and
    missing rows "unknown"; the first-order tables lay the tables' buckets out as their rows."""
    import pyarrow.parquet as pq

    from modules.optim.cowclip import BUCKET_LABELS
    from modules.embedding.sparse_arch import wide_row_offsets
    from pipeline.data.datamodule import CTRDataModule
    from pipeline.data.preprocess import preprocess
    from tests.click_logs import click_log
    from tests.test_own_data import declaration

    click_log(20_000, seed=3)[0].to_csv(tmp_path / "log.csv", index=False)
    data = declaration(preprocess={"min_count": 1, "split": {"method": "random", "valid": 0.0, "test": 0.0}})
    module = CTRDataModule(data, tmp_path, 1024, 1024, 0)
    module.store = preprocess([tmp_path / "log.csv"], data, tmp_path / "store")
    buckets, spec = module.row_buckets().tables, module.feature_spec
    for table in spec.table_sizes:
        counts = pq.read_table(tmp_path / "store" / "vocab" / f"{table}.parquet").column("count").to_numpy()
        want = np.concatenate([[0, 0], 1 + np.digitize(counts, [10, 100, 1000, 10000])])
        np.testing.assert_array_equal(buckets[f"emb_{table}"].numpy(), want, err_msg=table)
    assert set(np.unique(np.concatenate([b.numpy() for b in buckets.values()]))) >= {0, 1, 2, 3}, BUCKET_LABELS
    for name, features in (("wide", spec.bag_features), ("wide_seq", spec.seq_features)):
        for f, start in wide_row_offsets(spec, features).items():
            part = buckets[f"emb_{spec.table_of(f)}"]
            np.testing.assert_array_equal(buckets[name][start:start + len(part)].numpy(), part.numpy(), err_msg=f)


def _refusals(rank: int, world: int) -> None:
    from modules.optim.cowclip_hooks import attach_cowclip
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec

    dmp, _ = shard_model(ClipModel(device=torch.device("meta")), OptimizerSpec("rowwise_adagrad", 0.1),
                         TopologySpec(compute_device="cpu", sharding_types=["table_wise"]), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"2λ = 0.2 > scaling.cowclip.r = 0.05"):
        attach_cowclip(dmp, CFG, 0.1, "all", DecayRule("rowwise_adagrad", 0.1))
    with pytest.raises(ValueError, match="scaling.cowclip.fields must be null"):
        attach_cowclip(dmp, CowClipConfig(**{**CFG.__dict__, "fields": ["a"]}), L2, "all", DecayRule("rowwise_adagrad", L2))


def test_every_row_l2_refuses_what_the_lazy_replay_cannot_do():
    run_workers(_refusals, 1)
