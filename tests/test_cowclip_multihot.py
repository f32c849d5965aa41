"""CowClip on multi-hot (sequence) features and shared tables, against an explicit reference.

The model under test: SparseArch with a categorical feature ``a`` (bag collection), a categorical
``item`` and a sum-pooled sequence ``hist`` sharing one table, and a mean-pooled sequence ``tags``
(sequence collection, pooled by SparseArch), under DistributedModelParallel with FBGEMM's fused
optimizers, CowClip attached by ``attach_cowclip``.

The reference keeps full tables in float64, pools each bag explicitly (sum, or sum / length), takes
the gradient of the global-mean loss, and for every table row k present in the batch — counting every
occurrence of k in every bag of every feature reading the table (the paper's cnt_k) — adds 2λw_k
once, clips ``g_k`` to ``cnt_k·max(r‖w_k‖, ζ)`` and applies the optimizer's update rule.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from modules.optim.cowclip import CowClipConfig
from modules.embedding.sparse_arch import FeatureSpec, wide_row_offsets
from pipeline.data.store import Ragged, SplitArrays
from tests.dist_utils import run_workers
from tests.test_cowclip import DIM, ClipModel, score

SPEC = FeatureSpec((), ("a", "item"), {"a": 7, "item": 30, "tags": 12}, ("tags", "hist"),
                   {"tags": "mean", "hist": "sum"}, {"hist": "item"})
GLOBAL_BATCH, STEPS = 16, 3
LR = {"sgd": 0.5, "rowwise_adagrad": 0.1, "adagrad": 0.1}
CFG = CowClipConfig(enabled=True, r=0.05, zeta=1e-3)
L2 = 0.01
BAG_WIDE = wide_row_offsets(SPEC)
SEQ_WIDE = wide_row_offsets(SPEC, SPEC.seq_features)


def Net(device: torch.device | None = None) -> ClipModel:
    return ClipModel(device, SPEC)


def ragged(rng: np.random.Generator, n: int, max_len: int, size: int) -> Ragged:
    lengths = rng.integers(1, max_len + 1, n)
    values = np.minimum(rng.integers(0, size, lengths.sum()), rng.integers(0, size, lengths.sum()))  # skewed
    return Ragged(values.astype(np.int32), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def batches(seed: int = 0) -> list[SplitArrays]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = np.stack([rng.integers(0, 7, GLOBAL_BATCH), rng.integers(0, 30, GLOBAL_BATCH)], 1).astype(np.int32)
        out.append(SplitArrays(rng.integers(0, 2, GLOBAL_BATCH).astype(np.int8), np.zeros((GLOBAL_BATCH, 0), np.float32),
                               ids, {"tags": ragged(rng, GLOBAL_BATCH, 4, 12), "hist": ragged(rng, GLOBAL_BATCH, 5, 30)}))
    return out


def bags(r: Ragged, rows: np.ndarray) -> list[np.ndarray]:
    return [r.values[r.offsets[i]:r.offsets[i + 1]].astype(np.int64) for i in rows]


class Reference:
    def __init__(self, weights: dict[str, torch.Tensor], opt: str, world: int, scope: str) -> None:
        self.w = {k.split(".")[-2]: v.clone().double() for k, v in weights.items()}
        self.state = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.opt, self.world, self.scope = opt, world, scope
        self.clipped = self.unclipped = 0

    def _forward(self, w: dict, batch: SplitArrays, rows: np.ndarray) -> tuple[torch.Tensor, dict[str, list]]:
        """Scores of ``rows`` and every lookup made, as (table, row) lists per table."""
        lookups: dict[str, list[int]] = {t: [] for t in self.w}
        embs, firsts = [], []
        for i in rows:
            fields, first = [], 0.0
            for j, f in enumerate(("a", "item")):
                k = int(batch.sparse[i, j])
                t, wide, off = ("emb_" + SPEC.table_of(f), "wide" if f == "a" else "wide_seq",
                                BAG_WIDE[f] if f == "a" else SEQ_WIDE[f])
                fields.append(w[t][k])
                first = first + w[wide][k + off, 0]
                lookups[t].append(k)
                lookups[wide].append(k + off)
            for f in ("tags", "hist"):
                ids = bags(batch.sequences[f], [i])[0]
                t = "emb_" + SPEC.table_of(f)
                scale = 1.0 / len(ids) if SPEC.pooling[f] == "mean" else 1.0
                fields.append(w[t][torch.from_numpy(ids)].sum(0) * scale)
                first = first + w["wide_seq"][torch.from_numpy(ids + SEQ_WIDE[f]), 0].sum() * scale
                lookups[t] += ids.tolist()
                lookups["wide_seq"] += (ids + SEQ_WIDE[f]).tolist()
            embs.append(torch.stack(fields))
            firsts.append(first)
        return score(torch.stack(embs), torch.stack(firsts)), lookups

    def step(self, batch: SplitArrays) -> None:
        n = len(batch)
        parts = [np.arange(n)] if self.scope == "global" else np.split(np.arange(n), self.world)
        total = {k: torch.zeros_like(v) for k, v in self.w.items()}
        for rows in parts:
            w = {k: v.clone().requires_grad_(True) for k, v in self.w.items()}
            logits, lookups = self._forward(w, batch, rows)
            y = torch.from_numpy(batch.label[rows].astype(np.float64))
            (F.binary_cross_entropy_with_logits(logits, y, reduction="sum") / n).backward()
            for t, ids in lookups.items():
                counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=self.w[t].shape[0])
                for k in np.nonzero(counts)[0]:
                    g = w[t].grad[k] + 2 * L2 / len(parts) * self.w[t][k]
                    if t.startswith("emb_"):
                        threshold = counts[k] * max(CFG.r * float(self.w[t][k].norm()), CFG.zeta)
                        if float(g.norm()) > threshold:
                            self.clipped += 1
                            g = g * threshold / float(g.norm())
                        else:
                            self.unclipped += 1
                    total[t][k] += g
        for t, g in total.items():
            lr, s = LR[self.opt], self.state[t]
            if self.opt == "sgd":
                self.w[t] -= lr * g
            elif self.opt == "adagrad":
                s += g * g
                self.w[t] -= lr * g / (s.sqrt() + 1e-8)
            else:
                s += (g * g).mean(dim=1, keepdim=True)
                self.w[t] -= lr * g / (s.sqrt() + 1e-8)


def _worker(rank: int, world: int, optimizers: tuple[str, ...], sharding_types: tuple[str, ...], scope: str) -> None:
    for sharding_type in sharding_types:
        _check(rank, world, optimizers, sharding_type, scope)


def _check(rank: int, world: int, optimizers: tuple[str, ...], sharding_type: str, scope: str) -> None:
    from modules.optim.cowclip_hooks import attach_cowclip
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec
    from pipeline.data.batches import make_batch

    for opt in optimizers:
        torch.manual_seed(0)
        weights = {k: torch.randn_like(v) * 0.3 for k, v in Net().state_dict().items()}
        net = Net(device=torch.device("meta"))
        dmp, _ = shard_model(net, OptimizerSpec(opt, LR[opt]),
                             TopologySpec(compute_device="cpu", sharding_types=[sharding_type]), torch.device("cpu"),
                             table_of={f: SPEC.table_of(f) for f in SPEC.sparse})
        dmp.load_state_dict(weights)
        hooks = attach_cowclip(dmp, CowClipConfig(**{**CFG.__dict__, "scope": scope}), L2)
        if scope == "global":  # table-wise and row-wise shards of both collections (over all ranks): exact
            covered = [set() for _ in range(world)]
            torch.distributed.all_gather_object(covered, hooks.global_lookups)
            assert {"emb_a", "emb_item", "emb_tags"} <= set().union(*covered), covered
        else:
            assert {"emb_a", "emb_item", "emb_tags", "wide_hist"} <= hooks.local_lookups, hooks.local_lookups
        reference = Reference(weights, opt, world, "global" if hooks.global_lookups else "local")
        b = GLOBAL_BATCH // world
        for arrays in batches():
            batch = make_batch(arrays, np.arange(rank * b, (rank + 1) * b), SPEC.kjt_keys, categorical=SPEC.categorical)
            loss = F.binary_cross_entropy_with_logits(dmp(batch.dense_features, batch.sparse_features), batch.labels)
            loss.backward()
            reference.step(arrays)
        assert reference.clipped > 0 and reference.unclipped > 0, (reference.clipped, reference.unclipped)
        if world == 1:
            assert (hooks.stats.clipped, hooks.stats.ids) == (reference.clipped, reference.clipped + reference.unclipped)
        for key, value in dmp.state_dict().items():
            want = reference.w[key.split(".")[-2]].float()
            shards = value.local_shards() if hasattr(value, "local_shards") else None
            for shard in shards if shards is not None else []:
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                torch.testing.assert_close(shard.tensor, want[r0:r0 + nr, c0:c0 + nc], rtol=1e-5, atol=1e-6,
                                           msg=f"{opt} {key}")
            if shards is None:
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=f"{opt} {key}")


def test_pooling_matches_explicit_bags():
    """SparseArch's sum / mean pooling of sequence bags equals the bags pooled by hand."""
    torch.manual_seed(0)
    net = Net()
    arrays = batches()[0]
    from pipeline.data.batches import make_batch

    batch = make_batch(arrays, np.arange(GLOBAL_BATCH), SPEC.kjt_keys, categorical=SPEC.categorical)
    emb, first = net.sparse_arch(batch.sparse_features)
    with torch.no_grad():
        reference = Reference(net.state_dict(), "sgd", 1, "global")
        want, _ = reference._forward(reference.w, arrays, np.arange(GLOBAL_BATCH))
    torch.testing.assert_close(score(emb, first).double(), want, rtol=1e-5, atol=1e-5)
    assert emb.shape == (GLOBAL_BATCH, 4, DIM) and SPEC.kjt_keys == ("a", "item", "tags", "hist")


def test_single_process():
    run_workers(_worker, 1, ("sgd", "rowwise_adagrad"), ("table_wise",), "global")


def test_two_ranks_global_table_wise_and_row_wise():
    run_workers(_worker, 2, ("rowwise_adagrad",), ("table_wise", "row_wise"), "global")


def test_two_ranks_local():
    run_workers(_worker, 2, ("adagrad",), ("table_wise",), "local")
