"""Ids are checked against their tables by the model, and FBGEMM's own CPU check is off."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import KeyedJaggedTensor

from modules.embedding.sparse_arch import FeatureSpec
from modules.embedding.lookup_inputs import IdOutOfRangeError, check_ids
from modules.models.deepfm import DeepFM
from pipeline.data.batches import make_batch
from pipeline.data.store import SplitArrays
from tests.conftest import compose_config, train_cli
from tests.dist_utils import run_workers

SPEC = FeatureSpec(("I1",), ("a", "b", "c"), {"a": 10, "b": 7, "c": 20})


@st.composite
def _kjts(draw):
    """(keys, rows per key, stride, bags: per key per row a list of ids), some ids possibly outside."""
    k, b = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    rows = draw(st.lists(st.integers(1, 50), min_size=k, max_size=k))
    bags = [[draw(st.lists(st.integers(-3, n + 3), max_size=3)) for _ in range(b)] for n in rows]
    return [f"f{i}" for i in range(k)], rows, b, bags


@settings(max_examples=200, deadline=None)
@given(_kjts())
def test_check_ids_refuses_exactly_the_batches_with_an_id_outside_its_table(case):
    keys, rows, b, bags = case
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor([i for key in bags for bag in key for i in bag],
                                                           dtype=torch.int32),
                            lengths=torch.tensor([len(bag) for key in bags for bag in key], dtype=torch.int32),
                            stride=b)
    first_bad = next(((keys[k], i) for k, key in enumerate(bags) for bag in key for i in bag
                      if not 0 <= i < rows[k]), None)  # in value order: key after key, bag after bag
    if first_bad is None:
        check_ids(kjt, torch.tensor(rows))
        return
    with pytest.raises(IdOutOfRangeError) as e:
        check_ids(kjt, torch.tensor(rows))
    key, bad = first_bad
    assert str(e.value) == (f"feature {key!r}: id {bad} is outside its table's rows "
                            f"[0, {rows[keys.index(key)]})")


def _batch(c_ids: list[int]):
    n = len(c_ids)
    rng = np.random.default_rng(0)
    sparse = np.stack([rng.integers(0, 10, n), rng.integers(0, 7, n), np.array(c_ids)], 1).astype(np.int32)
    arrays = SplitArrays(rng.integers(0, 2, n).astype(np.int8), rng.normal(size=(n, 1)).astype(np.float32), sparse)
    return make_batch(arrays, np.arange(n), list(SPEC.categorical))


def _sharded_worker(rank: int, world_size: int, stack: bool) -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec

    net = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8], stack_tables=stack, device=torch.device("meta"))
    dmp, _ = shard_model(net, OptimizerSpec("rowwise_adagrad", 0.1), TopologySpec(compute_device="cpu"),
                         torch.device("cpu"))
    kernels = [kernel._emb_module for lookup in dmp.module.sparse_arch.ebc._lookups  # TorchRec's internals:
               for kernel in lookup._emb_modules]  # its FBGEMM modules are not registered submodules
    assert all(isinstance(k, SplitTableBatchedEmbeddingBagsCodegen) for k in kernels)
    assert kernels and all(k.bounds_check_mode_int == BoundsCheckMode.NONE.value for k in kernels)

    def state() -> list[torch.Tensor]:
        return [w.clone() for k in kernels for w in k.split_embedding_weights()]

    before = state()
    valid = _batch([0, 19, 5, 3])
    dmp(valid.dense_features, valid.sparse_features).sum().backward()  # the tables' fused update runs
    trained = state()
    assert any(not torch.equal(a, b) for a, b in zip(before, trained))
    # every FBGEMM lookup counted: a check placed after the lookups would let a kernel run on the bad id
    # (out of bounds: FBGEMM's own check is off) even though the forward still raises before any backward
    lookups = [0]
    for k in kernels:
        k.register_forward_pre_hook(lambda module, inputs: lookups.__setitem__(0, lookups[0] + 1))
    for bad in (20, -1):
        batch = _batch([0, bad, 5, 3])
        with pytest.raises(IdOutOfRangeError, match=rf"^feature 'c': id {bad} is outside its table's rows \[0, 20\)$"):
            dmp(batch.dense_features, batch.sparse_features)  # the forward raises: no output, so no backward
        assert lookups[0] == 0  # refused before any lookup
    dmp(valid.dense_features, valid.sparse_features).sum().backward()
    assert lookups[0] == len(kernels)  # the counter sees lookups: a valid batch makes one per kernel


def test_sharded_model_refuses_an_id_outside_its_table_without_fbgemms_check():
    for stack in (False, True):
        run_workers(_sharded_worker, 1, stack)


def test_the_look_ahead_refuses_an_id_outside_its_table_before_a_row_cache_sees_it():
    """The ssd tier's look-ahead hands the next batch's ids to the row caches' C loops from SparseArch.inputs,
    before that batch's forward: the ids are checked there too."""
    arch = DeepFM(SPEC, embedding_dim=8, mlp=[16, 8]).sparse_arch
    assert [c for c, _ in arch.inputs(_batch([0, 19, 5, 3]).sparse_features)] == [arch.ebc]
    for bad in (20, -1):
        with pytest.raises(IdOutOfRangeError, match=rf"^feature 'c': id {bad} is outside its table's rows \[0, 20\)$"):
            arch.inputs(_batch([0, bad, 5, 3]).sparse_features)


def test_train_on_the_ssd_tier_with_look_ahead_on_a_store_with_a_bad_id_ends_with_a_user_error(
        small_overrides, cache_dir, tmp_path):
    """A store with an id below its table (-1, row 5,000: batch 4 of 1,024 rows, which the look-ahead meets
    first) and one past it; every table on the ssd tier, look-ahead on: the run ends with the user error."""
    from pipeline.config import parse_config
    from pipeline.data.sources import store_dir
    from pipeline.data.store import ColumnarStore
    from tests.test_ssd_tier import ALL_ON_SSD, SMALL_CACHE

    cfg = parse_config(compose_config(small_overrides))
    source = store_dir(cfg.data, cache_dir)
    copy = tmp_path / "cache" / source.relative_to(cache_dir)
    shutil.copytree(source, copy)
    store = ColumnarStore(copy)
    feature = store.categorical_names[2]
    rows = store.table_sizes[feature]
    sparse = np.load(Path(copy) / "train" / "sparse.npy", mmap_mode="r+")
    sparse[5000, 2] = -1
    sparse[9000, 2] = rows  # one past the last row of its table
    sparse.flush()
    del sparse
    proc, _ = train_cli([*small_overrides, f"paths.cache_dir={tmp_path / 'cache'}", "trainer.max_epochs=1",
                         "trainer.shuffle=false", f"topology.ssd.path={tmp_path}/ssd", ALL_ON_SSD, SMALL_CACHE,
                         "topology.ssd.look_ahead=true", f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"],
                        tmp_path / "run", check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (f"Error (IdOutOfRangeError): feature '{feature}': id -1 is outside its table's rows "
            f"[0, {rows})") in proc.stdout + proc.stderr


@pytest.mark.parametrize("background", [False, True])
def test_a_loader_for_a_gpu_checks_ids_on_the_host_in_the_thread_that_builds_the_batches(background, monkeypatch):
    """On CUDA the model does not check (a host sync per batch) and FBGEMM's check only clamps: the loader checks
    each host batch as it builds it — for training in its own thread (``background``), off the training thread —
    and the error reaches the consumer at the batch that holds the id."""
    import threading

    import pipeline.data.batches as batches
    from pipeline.data.batches import BatchLoader

    seen = []
    for name in ("check_ids", "check_ids_in_slot"):
        real = getattr(batches, name)
        monkeypatch.setattr(batches, name, lambda *a, _real=real: seen.append(threading.current_thread().name)
                            or _real(*a))
    c = [1] * 12
    c[9] = 25  # in the third batch of 4
    arrays = _batch(c)
    loader = BatchLoader(SplitArrays(arrays.labels.numpy().astype(np.int8), arrays.dense_features.numpy(),
                                     _rows(c)), list(SPEC.categorical), 4, 0, 1, train=True, shuffle=False,
                         background=background, table_rows=[SPEC.table_sizes[t] for t in SPEC.categorical])
    it = iter(loader)
    for _ in range(2):
        next(it).to(torch.device("cpu"))
    with pytest.raises(IdOutOfRangeError, match="feature 'c': id 25 is outside its table's rows \\[0, 20\\)"):
        next(it)
    assert len(seen) == 3 and set(seen) == {"prefetch" if background else threading.current_thread().name}


def _rows(c_ids: list[int]) -> np.ndarray:
    rng = np.random.default_rng(0)
    n = len(c_ids)
    return np.stack([rng.integers(0, 10, n), rng.integers(0, 7, n), np.array(c_ids)], 1).astype(np.int32)


