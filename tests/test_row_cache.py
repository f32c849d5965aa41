"""The ``ssd`` tier's row cache (modules/embedding/ssd_tier/row_cache.py, modules/embedding/ssd_tier/cached_tbe.py) against tables in host
memory: the same FBGEMM kernel on slots gives the same numbers to the last bit, with caches small
enough that most rows are evicted and read back; the files hold exactly the trained rows after a
sync; rows are drawn from (seed, table, row) wherever they sit (modules/embedding/row_init.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from modules.embedding.ssd_tier.cached_tbe import cached_tbes
from modules.embedding.table_views import reload_tables, sync_tables
from modules.optim.optimizers import OptimizerSpec
from modules.embedding.ssd_tier.set_victims import CacheTooSmallError
from modules.embedding.row_init import RowInit, normal_rows
from modules.sharding.planner import shard_model
from modules.sharding.topology import SsdSpec, TopologySpec
from tests.dist_utils import run_workers

ROWS = {"a": 40_000, "b": 9_000, "w": 49_000}  # w: 4 columns, as the first-order table
DIM = 16


def _model(seed: int = 7) -> torch.nn.Module:
    tables = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=4 if n == "w" else DIM,
                                 feature_names=[f"f_{n}"], pooling=PoolingType.SUM,
                                 init_fn=RowInit.of_tables(seed, 0.0 if n == "w" else 0.05, [n], [r]))
              for n, r in ROWS.items()]
    return torch.nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=tables, device=torch.device("meta"))})


def _batches(steps: int, batch: int, seed: int = 0) -> list[KeyedJaggedTensor]:
    """Zipf-like ids with a long tail (most rows are met rarely: the small caches evict them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values, lengths = [], []
        for n, r in ROWS.items():
            u = torch.rand(batch, generator=g)
            values.append(torch.clamp((r * u ** 3).long(), max=r - 1))
            lengths.append(torch.ones(batch, dtype=torch.int64))
        out.append(KeyedJaggedTensor.from_lengths_sync([f"f_{n}" for n in ROWS], torch.cat(values),
                                                       torch.cat(lengths)))
    return out


def _train(topology: TopologySpec, batches: list[KeyedJaggedTensor], optimizer: str,
           batch_rows: int = 0) -> tuple[dict, object]:
    dmp, plan = shard_model(_model(), OptimizerSpec(optimizer, 0.05), topology, torch.device("cpu"),
                            batch_rows=batch_rows)
    for kjt in batches:
        out = dmp.module["ebc"](kjt)
        (out.values() ** 2).sum().backward()
    sync_tables(dmp)
    weights = {k: v.local_shards()[0].tensor.clone() for k, v in dmp.state_dict().items()}
    states = {k: {s: t.local_shards()[0].tensor.clone() if hasattr(t, "local_shards") else t.clone()
                  for s, t in v.items()} for k, v in dmp.fused_optimizer.state_dict()["state"].items()}
    return {"weights": weights, "states": states}, dmp


def _run_against_host(rank: int, world: int, folder: str, policy: str, optimizer: str) -> None:
    batches = _batches(30, 1024)
    host, _ = _train(TopologySpec(compute_device="cpu"), batches, optimizer)
    ssd = TopologySpec(compute_device="cpu", ddr_cap_gb=1e-12,  # a budget below one row: every table on ssd
                       ssd=SsdSpec(path=folder, cache_mb=2.0, cache_policy=policy))  # the floors: 1.1-1.7 MB
    cached, dmp = _train(ssd, batches, optimizer, batch_rows=1024)
    tbes = cached_tbes(dmp)
    assert tbes and all(t.cache_slots < sum(ROWS.values()) / 3 for t in tbes)
    stats = [t.cache.stats for t in tbes]
    assert sum(s.rows_written for s in stats) > 0 and sum(s.rows_read for s in stats) > 0, stats  # evictions
    for kind in ("weights", "states"):
        assert host[kind].keys() == cached[kind].keys()
        for k in host[kind]:
            a, b = host[kind][k], cached[kind][k]
            same = torch.equal(a, b) if kind == "weights" else all(torch.equal(a[s], b[s]) for s in a)
            assert same, f"{kind} {k} differ"
    # the files hold the trained rows: their bytes, read with read(2), are the host-memory tables
    files = sorted(Path(folder, "rank0").glob("*.weights.f32"))
    for tbe in tbes:
        on_disk = torch.from_numpy(np.fromfile(next(f for f in files if all(n in f.name for n in tbe.table_names)),
                                               dtype=np.float32))
        for i, name in enumerate(tbe.table_names):
            w = host["weights"][f"ebc.embedding_bags.{name}.weight"]
            start = int(tbe.weights_offsets[i])
            assert torch.equal(on_disk[start:start + w.numel()].view_as(w), w), name


@pytest.mark.parametrize("policy,optimizer", [("lru", "rowwise_adagrad"), ("lfu", "adagrad")])
def test_row_cache_trains_bit_for_bit_like_host_memory_while_evicting(tmp_path, policy, optimizer):
    run_workers(_run_against_host, 1, str(tmp_path / "ssd"), policy, optimizer)


def _too_small(rank: int, world: int, folder: str) -> None:
    ssd = TopologySpec(compute_device="cpu", ddr_cap_gb=1e-12, ssd=SsdSpec(path=folder, cache_mb=1.2))
    with pytest.raises(CacheTooSmallError, match="raise topology.ssd.cache_mb"):
        _train(ssd, _batches(1, 20_000), "sgd")


def test_a_batch_larger_than_the_cache_is_refused_with_the_key_to_raise(tmp_path):
    run_workers(_too_small, 1, str(tmp_path / "ssd"))


def _reload_after_outside_write(rank: int, world: int, folder: str) -> None:
    ssd = TopologySpec(compute_device="cpu", ddr_cap_gb=1e-12, ssd=SsdSpec(path=folder, cache_mb=1.2))
    _, dmp = _train(ssd, _batches(3, 256), "sgd")
    weight = dmp.state_dict()["ebc.embedding_bags.a.weight"].local_shards()[0].tensor
    weight[:] = 1.5  # as a checkpoint load writes into the files
    reload_tables(dmp)
    out = dmp.module["ebc"](_batches(1, 64)[0])
    assert torch.all(out["f_a"] == 1.5)  # read from the file, not the stale slots


def test_the_cache_reads_the_files_again_after_they_were_written_from_outside(tmp_path):
    run_workers(_reload_after_outside_write, 1, str(tmp_path / "ssd"))


def test_rows_are_drawn_from_seed_table_and_row_whatever_the_layout():
    init = RowInit.of_tables(3, 0.1, ["x", "y"], [100, 50])  # a stacked table of x then y
    whole = init(torch.empty(150, 8))
    alone = RowInit.of_tables(3, 0.1, ["y"], [50])(torch.empty(50, 8))
    assert torch.equal(whole[100:], alone)
    assert torch.equal(init.rows(torch.tensor([120, 3]), 8), whole[[120, 3]])
    # an independent reference: SplitMix64 as published, in Python integers, and Box-Muller in float64
    import math
    import zlib

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    base = mix(3 ^ mix(zlib.crc32(b"y")))
    x = mix((base + (7 * 8 + 2 + 1) * 0x9E3779B97F4A7C15) % 2**64)  # row 7, column 2
    u1, u2 = ((x >> 40) + 0.5) / 2**24, ((x & 0xFFFFFF) + 0.5) / 2**24
    expected = 0.1 * math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)  # float64: the float32 one rounds
    assert alone[7, 2].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    draws = normal_rows(11, 5, np.arange(20_000), 16, 1.0)
    assert abs(draws.mean().item()) < 0.01 and abs(draws.std().item() - 1.0) < 0.01
