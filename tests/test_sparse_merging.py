"""Copies of the embedding tables merged row by row (modules/optim/sparse_merging.py) on gloo processes: the merged
rows against the formula (the updates of the copies that looked a row up, summed, over √n) computed from every
rank's tables and lookups with numpy, the bytes it sends, a real model sharded over each rank's own group trained on
different data, and one sharded row-wise over each node's two ranks (tables=per_node: 2 nodes x 2 ranks)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_workers
from tests.test_kstep_merging import SPEC, _batch


def _gathered(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[np.ndarray]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return [o.numpy() for o in out]


def update_bytes(hits: dict[str, np.ndarray], dims: dict[str, int], size: int) -> int:
    """What one rank sends of a merge's row updates (``hits[name]``: which rows each rank met, ranks × rows): per row
    width d, its own rows' updates padded to the longest rank's L (all-gathered) where W·L·d < 2·U·(d + 1), else the
    union's U rows' updates and a count (all-reduced); ``size`` bytes a value."""
    total = 0
    for d in sorted(set(dims.values())):
        names = [n for n in hits if dims[n] == d]
        met = sum(hits[n].sum(1) for n in names)  # rows each rank met
        longest, union, world = int(met.max()), sum(int(hits[n].any(0).sum()) for n in names), len(met)
        if union:
            total += size * (longest * d if world * longest * d < 2 * union * (d + 1) else union * (d + 1))
    return total


def _formula_worker(rank: int, world: int, updates: str, shared: bool, rows: torch.dtype = torch.float32) -> None:
    """``shared``: every rank meets mostly the same rows (the union's all-reduce is the cheaper exchange), else rows
    of their own (each rank's own updates all-gathered). ``rows``: the tables' type (fp16: model.table_precision)."""
    from modules.comm_accounting import CommCounter, install
    from modules.optim.sparse_merging import TableMerger

    shapes = {"wide": (50, 1), "a": (40, 4), "b": (30, 4)}
    start = {n: torch.randn(s, generator=torch.Generator().manual_seed(i)).to(rows) for i, (n, s) in enumerate(shapes.items())}
    tables = {n: t.clone() for n, t in start.items()}
    merger = TableMerger(tables, updates)
    rng = np.random.default_rng(rank)
    common = np.random.default_rng(99)
    for name, t in tables.items():  # each rank changes the rows it "looks up", by its own amounts
        ids = torch.from_numpy(rng.choice(t.shape[0], t.shape[0] // 3, replace=False))
        if shared:  # the same rows on every rank, and one of its own
            ids = torch.from_numpy(np.union1d(common.choice(t.shape[0], t.shape[0] // 2, replace=False), ids[:1]))
        merger.record(name, torch.cat([ids, ids[:3]]))  # before the update, as the lookup; twice counts once
        t[ids] += torch.from_numpy(rng.normal(size=(len(ids), t.shape[1])).astype(np.float32)).to(rows)
    before = {n: _gathered(t) for n, t in tables.items()}
    touched = {n: _gathered(merger.touched[merger.first_row[n]:merger.first_row[n] + t.shape[0]].clone())
               for n, t in tables.items()}
    local = int(merger.touched.sum())
    longest = max(int(a[0]) for a in _gathered(torch.tensor([local])))
    install()  # in this worker process, which ends with the test
    counter = CommCounter()
    counter.start()
    merged = merger.merge()
    counter.stop()
    union_by_dim: dict[int, int] = {}
    for name, t in tables.items():
        w, hit = np.stack(before[name]).astype(np.float64), np.stack(touched[name])  # (ranks, rows, dim), (ranks, rows)
        n = hit.sum(0)
        b = start[name].double().numpy()
        expected = b + ((w - b) * hit[..., None]).sum(0) / np.sqrt(np.maximum(n, 1))[:, None]  # Σ updates / √n
        tol = 1e-6 if updates == "fp32" else 2e-3  # fp16 keeps ~11 bits of an update (these are ~N(0, 1))
        if rows == torch.float16:  # and the merged row rounded to fp16 once: within one unit in its last place
            assert t.dtype == torch.float16
            tol = max(tol, 2**-10)
            np.testing.assert_allclose(t.double().numpy(), expected, rtol=tol, atol=2**-14)
        else:
            np.testing.assert_allclose(t.numpy(), expected, rtol=tol, atol=tol)
        assert (n >= 2).any() and (n == 1).any(), name  # rows met by several ranks and by one
        union_by_dim[t.shape[1]] = union_by_dim.get(t.shape[1], 0) + int((n > 0).sum())
    assert merged == sum(union_by_dim.values())
    # the count, the padded int32 ids, then per width the updates of the cheaper exchange
    hits = {n: np.stack(touched[n]) for n in tables}
    dims = {n: t.shape[1] for n, t in tables.items()}
    assert counter.bytes["merge"] == 8 + 4 * longest + update_bytes(hits, dims, 4 if updates == "fp32" else 2)
    gathered = update_bytes(hits, dims, 1) == sum(int(sum(hits[n].sum(1) for n in hits if dims[n] == d).max()) * d
                                                  for d in set(dims.values()))
    assert gathered == (not shared)  # the exchange each case is for
    assert not merger.touched.any()


def _formula_workers(rank: int, world: int) -> None:
    from modules.optim.sparse_merging import TableMerger

    same, other = torch.ones(70_000, 2), torch.full((5, 3), float(rank))  # more rows than a checksum block
    TableMerger({"same": same, "other": other}).make_equal()
    assert torch.equal(other, torch.zeros(5, 3)) and torch.equal(same, torch.ones(70_000, 2))  # rank 0's
    for updates in ("fp32", "fp16"):  # one set of processes for every case (each start imports torch)
        for shared in ((False, True) if world > 2 else (False,)):
            _formula_worker(rank, world, updates, shared)
    _formula_worker(rank, world, "fp32", world > 2, torch.float16)  # fp16 rows


@pytest.mark.parametrize("ranks", [2, 4])
def test_merged_rows_get_the_updates_summed_over_root_n(ranks):
    """2 ranks: each rank's own updates all-gathered; 4 ranks: also rows every rank meets, whose union is
    all-reduced."""
    run_workers(_formula_workers, ranks)


def _model_worker(rank: int, world: int) -> None:
    from modules.embedding.sparse_arch import is_table_parameter
    from modules.models.deepfm import DeepFM
    from modules.optim.kstep_merging import KStepMerger, MergeConfig
    from modules.optim.optimizers import OptimizerSpec, replicated_parameters
    from modules.sharding.planner import shard_model
    from modules.sharding.replicated_tables import attach_table_merger, copy_group
    from modules.sharding.topology import TopologySpec
    from pipeline.model_folder.table_files import holds_rank_0s_copy

    torch.manual_seed(rank)  # the dense part differs; the tables are drawn from the same seed
    net = DeepFM(SPEC, embedding_dim=4, mlp=[8], device=torch.device("meta"))
    topology = TopologySpec(compute_device="cpu", sharding_types=["table_wise"])
    model, _ = shard_model(net, OptimizerSpec("adagrad", 0.1), topology, torch.device("cpu"), data_parallel=False,
                           group=copy_group(1, timedelta(seconds=120)))
    tables = attach_table_merger(model)
    assert sum(w.shape[0] for w in tables.tables.values()) >= 37  # every table whole on this rank
    assert all(holds_rank_0s_copy(v) == (rank == 0) for k, v in model.state_dict().items()
               if is_table_parameter(k))  # rank 0's copy alone goes into the model folder
    # tables sharded over all ranks are one copy: every rank writes its shards, of tables rank 0 holds none of too
    one_copy, _ = shard_model(DeepFM(SPEC, embedding_dim=4, mlp=[8], device=torch.device("meta")),
                              OptimizerSpec("adagrad", 0.1), topology, torch.device("cpu"), data_parallel=False)
    sharded = [v for k, v in one_copy.state_dict().items() if is_table_parameter(k)]
    assert all(holds_rank_0s_copy(v) for v in sharded) and any(not v.local_shards() for v in sharded)
    params = [p for _, p in replicated_parameters(model)]
    merger = KStepMerger(params, MergeConfig(k=3, tables="replicated"), tables=tables)
    start = {n: w.clone() for n, w in tables.tables.items()}
    optimizer = torch.optim.Adam(params, lr=0.01)
    model.train()
    for step in range(1, 4):
        b = _batch(step, rank)  # different rows on each rank
        F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features), b.labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step < 3:
            assert not merger.after_step()
            continue
        seen = {n: _gathered(tables.touched[tables.first_row[n]:tables.first_row[n] + w.shape[0]].clone())
                for n, w in tables.tables.items()}
        before = {n: _gathered(w.clone()) for n, w in tables.tables.items()}
        assert merger.after_step()
    for name, w in tables.tables.items():
        hit = np.stack(seen[name])
        assert hit.any(), name  # the hooks saw the training lookups
        changed = (np.stack(before[name]) != start[name].numpy()).any(-1)
        assert not (changed & ~hit).any(), name  # only looked-up rows moved
        only = hit[rank] & ~hit[1 - rank]
        np.testing.assert_allclose(w.numpy()[only], before[name][rank][only], rtol=1e-6, atol=1e-7)  # whole, not halved
        both = hit[0] & hit[1]
        b = start[name].numpy()[both]
        np.testing.assert_allclose(w.numpy()[both], b + ((before[name][0][both] - b) + (before[name][1][both] - b))
                                   / np.sqrt(2), rtol=1e-5, atol=1e-6)  # both ranks' updates, over √2
    # the merge wrote into the kernels' own rows: both ranks now score a batch alike
    model.eval()
    b = _batch(99, 0)
    with torch.no_grad():
        out = model(b.dense_features, b.sparse_features)
    theirs = _gathered(out)
    np.testing.assert_allclose(theirs[0], theirs[1], rtol=1e-6)
    # overlapped merges (trainer.merging.overlap) over the same kernels: replicas differ while merges are in
    # flight; the final merge makes them score alike again
    late = KStepMerger(params, MergeConfig(k=2, tables="replicated", overlap=1), tables=attach_table_merger(model))
    for step in range(4, 9):
        model.train()
        b = _batch(step, rank)
        F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features), b.labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        late.after_step()
    model.eval()
    b, scores = _batch(99, 0), []
    for _ in range(2):
        with torch.no_grad():
            scores.append(_gathered(model(b.dense_features, b.sparse_features)))
        late.merge_if_dirty()
    assert np.abs(scores[0][0] - scores[0][1]).max() > 1e-4  # a pass in flight, another not merged
    np.testing.assert_allclose(scores[1][0], scores[1][1], rtol=1e-5, atol=1e-6)


def test_a_model_with_replicated_tables_merges_the_rows_looked_up():
    run_workers(_model_worker, 2)


def _per_node_worker(rank: int, world: int, folder: str) -> None:
    from pathlib import Path

    from modules.embedding.sparse_arch import is_table_parameter
    from modules.models.deepfm import DeepFM
    from modules.optim.kstep_merging import KStepMerger, MergeConfig
    from modules.optim.optimizers import OptimizerSpec, replicated_parameters
    from modules.sharding.planner import shard_model
    from modules.sharding.replicated_tables import attach_table_merger, copy_group, peer_group
    from modules.sharding.topology import TopologySpec
    from pipeline.model_folder.table_files import holds_rank_0s_copy, mapped
    from pipeline.model_folder.weights import unsharded_state

    node = rank // 2  # ranks 0, 1 are node 0; 2, 3 node 1; a shard's peers: the same local rank on the other node
    torch.manual_seed(rank)
    net = DeepFM(SPEC, embedding_dim=4, mlp=[8], device=torch.device("meta"))
    topology = TopologySpec(compute_device="cpu", sharding_types=["row_wise"])
    model, _ = shard_model(net, OptimizerSpec("adagrad", 0.1), topology, torch.device("cpu"), data_parallel=True,
                           group=copy_group(2, timedelta(seconds=120)))
    # (shard_model gave the node's DDP its hook: DDP's all-reduce counted and over the node's ranks, as in a run)
    tables, peers = attach_table_merger(model), peer_group(2)
    assert any("@" in name for name in tables.tables) == (rank % 2 == 1)  # row-wise: local rank 1 holds later rows
    params = [p for _, p in replicated_parameters(model)]
    merger = KStepMerger(params, MergeConfig(k=3, tables="per_node"), tables=tables, table_group=peers)
    start = {n: w.clone() for n, w in tables.tables.items()}
    optimizer = torch.optim.Adam(params, lr=0.01)
    model.train()
    met: dict[str, set[int]] = {f: set() for f in SPEC.categorical}  # the ids this node's two ranks looked up
    for step in range(1, 4):
        for r in (2 * node, 2 * node + 1):
            for f, ids in zip(SPEC.categorical, _batch(step, r).sparse_features.to_dict().values()):
                met[f] |= set(ids.values().tolist())
        b = _batch(step, rank)
        F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features), b.labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            dense = _gathered(torch.cat([p.detach().reshape(-1) for p in params]))
            np.testing.assert_array_equal(dense[2 * node], dense[2 * node + 1])  # DDP inside the node
            assert np.abs(dense[0] - dense[2]).max() > 0  # the nodes trained apart
            seen = {n: _gathered(tables.touched[tables.first_row[n]:tables.first_row[n] + w.shape[0]].clone(), peers)
                    for n, w in tables.tables.items()}
            before = {n: _gathered(w.clone(), peers) for n, w in tables.tables.items()}
        assert merger.after_step() == (step == 3)
    for name, w in tables.tables.items():
        table, _, offsets = name.partition("@")
        first = int(offsets.split(",")[0]) if offsets else 0
        hit = np.stack(seen[name])
        if table.startswith("emb_"):  # the rows the kernel recorded are those the node's batches met in this shard
            expected = np.zeros(w.shape[0], bool)
            expected[[i - first for i in met[table[4:]] if first <= i < first + w.shape[0]]] = True
            np.testing.assert_array_equal(hit[node], expected, err_msg=name)
        changed = (np.stack(before[name]) != start[name].numpy()).any(-1)
        assert not (changed & ~hit).any(), name
        n = hit.sum(0)
        b = start[name].numpy()
        want = b + ((np.stack(before[name]) - b) * hit[..., None]).sum(0) / np.sqrt(np.maximum(n, 1))[:, None]
        np.testing.assert_allclose(w.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert (n == 2).any() or not hit.any(), name
    model.eval()  # every rank of both nodes now scores a batch alike
    b = _batch(99, 0)
    with torch.no_grad():
        scores = _gathered(model(b.dense_features, b.sparse_features))
    for other in scores[1:]:
        np.testing.assert_allclose(other, scores[0], rtol=1e-5, atol=1e-6)
    # the model folder's tables are written by node 0's copy alone (node 1's files need not be on rank 0's node)
    state = {k: v for k, v in model.state_dict().items() if is_table_parameter(k)}
    assert state and all(holds_rank_0s_copy(v) == (node == 0) for v in state.values())
    if node == 1:
        for w in tables.tables.values():
            w.add_(1.0)  # were these written, node 0's rows would not be all there is
    unsharded_state(model, Path(folder))
    if node == 0:
        for key, value in state.items():
            written = mapped(Path(folder) / f"{key}.f32", tuple(value.size()))
            for shard in value.local_shards():
                r, c = shard.metadata.shard_offsets
                rows, cols = shard.tensor.shape
                torch.testing.assert_close(written[r:r + rows, c:c + cols], shard.tensor, rtol=0, atol=0)


def test_tables_per_node_are_sharded_inside_a_node_and_merged_across_nodes(tmp_path):
    run_workers(_per_node_worker, 4, str(tmp_path))


def _layouts_differ(rank: int, world: int) -> None:
    from modules.optim.sparse_merging import TableMerger

    same = TableMerger({"emb_a": torch.zeros(10, 4), "emb_b": torch.zeros(6, 4)})
    same.make_equal()  # alike: passes
    shards = {"emb_a": torch.zeros(10, 4)} | ({"emb_b": torch.zeros(6, 4)} if rank == 0 else
                                              {"emb_b@3,0": torch.zeros(3, 4)})
    with pytest.raises(RuntimeError, match=r"not sharded alike: this rank holds \[\('emb_b(@3,0)?', \((6|3), 4\)\)\], "
                                           r"where rank (0|1) of its merge group holds"):
        TableMerger(shards).make_equal()


def test_copies_sharded_differently_are_refused_before_any_merge():
    """Each node plans its copy alone: peers holding other shards would merge unrelated rows."""
    run_workers(_layouts_differ, 2)
