"""The CUDA path, checked on a CPU (CI has no GPU; ``benchmarks/gpu_check.py`` runs the same path on one).

* Lightning builds the model under ``torch.device(root_device)``: what is made there without a device lands in GPU
  memory. :mod:`tests.meta_init_run` builds it under ``torch.device("meta")`` instead; every host structure must stay
  on the CPU, the tables must hold the drawn rows, and the run must end exactly where a plain run does.
* NCCL takes device tensors only: under :mod:`tests.device_only_backend` (a default group that refuses host tensors,
  as NCCL does) every host-side collective of the project must still work, over the gloo twin.
* The options that do not run on CUDA yet are refused before any work, naming the key.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist

from pipeline.config import check_runnable, parse_config
from pipeline.runtime.errors import ConfigError
from pipeline.training.link_choice import check_link_settings
from pipeline.training.strategy import TorchRecStrategy
from tests.conftest import PYTHON, ROOT, compose_config, subprocess_env
from tests.device_only_backend import NAME as DEVICE_ONLY, REFUSAL
from tests.dist_utils import run_workers
from tests.test_config import check_config


def _run(module: str, overrides: list[str], folder) -> dict:
    """``python -m <module> <overrides>`` with :class:`tests.meta_checks.HostStructures` after 2 steps and
    :class:`tests.meta_checks.DeviceMoves`; their findings (``moves``: the latter's) and the run's result."""
    out, moves = folder / "host_structures.json", folder / "moves.json"
    args = [*overrides, f"hydra.run.dir={folder}", f"logger.tracking_uri=sqlite:///{folder}/mlflow.db",
            f"trainer.callbacks=[{{_target_: tests.meta_checks.HostStructures, out: '{out}'}}, "
            f"{{_target_: tests.meta_checks.DeviceMoves, out: '{moves}'}}]"]
    proc = subprocess.run([PYTHON, "-m", module, *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {**json.loads(out.read_text()), **json.loads((folder / "result.json").read_text()),
            "moves": json.loads(moves.read_text())}


@pytest.fixture(scope="module")
def meta_and_plain(small_overrides, tmp_path_factory):
    """The same 3 steps built under ``torch.device("meta")`` and plainly, with CowClip (its statistics and row
    buckets), the L2 term on every row (its replay's buffers), the tables stacked (rows drawn table by table into
    one) and early stopping (its best-epoch restore runs after Lightning's teardown)."""
    variant = ["optim=reference", "scaling=cowclip", "optim.embedding_l2_scope=all", "optim.embedding_l2=1e-4",
               "model.stack_tables=true", "trainer.early_stopping_patience=1"]
    overrides = [*small_overrides, *variant, "trainer.max_steps=3", "trainer.max_epochs=1"]
    tmp = tmp_path_factory.mktemp("device_paths")
    return _run("tests.meta_init_run", overrides, tmp / "meta"), _run("pipeline.commands.train", overrides, tmp / "plain")


def test_a_model_built_under_lightnings_device_context_keeps_host_structures_on_the_cpu(meta_and_plain):
    meta, plain = meta_and_plain
    assert meta["held"], "the walk found none of the run's host structures: it checks nothing"
    assert meta["not_on_cpu"] == {}, meta["not_on_cpu"]
    assert meta["rows_differ"] == [] and plain["rows_differ"] == []
    # the same seed gives the same model whatever the default device: the dense layers and the seed of the rows
    # come from the CPU generator (on CUDA they came from the GPU's)
    assert (meta["test_auc"], meta["test_logloss"]) == (plain["test_auc"], plain["test_logloss"])
    assert meta["held"] == plain["held"]


def test_model_to_device_sets_the_modules_device():
    """Lightning creates logged numbers on the module's device and reduces them over the default group (NCCL on a
    GPU): the module must report the root device though the strategy moves nothing (DMP placed the shards)."""
    strategy = TorchRecStrategy(parallel_devices=[torch.device("meta")])
    module = L.LightningModule()
    strategy.connect(module)
    strategy.model_to_device()
    assert module.device == torch.device("meta")


def test_nothing_moves_the_model_between_fit_and_test_and_the_strategy_sets_its_device(meta_and_plain):
    """Lightning's ``Strategy.teardown`` moves the module and its optimizers' state to the CPU when ``fit`` ends; the
    run then tests that module with batches on the GPU. On a CPU that move changes nothing, so the calls are spied
    on (tests.meta_checks.DeviceMoves), with early stopping on (its best-epoch restore runs after the teardown)."""
    _, plain = meta_and_plain
    seen = plain["moves"]
    assert seen["moves"] == [], seen  # was: ['optimizers_to_device(cpu)', "cpu()"] from Strategy.teardown
    assert seen["model_to_device"] == 2 and seen["module_device"] == "cpu"  # in fit's setup and test's; was never
    assert 0 < plain["test_auc"] < 1  # the test ran on that model


def _host_collectives(rank: int, world: int) -> None:
    from modules import host_collectives
    from modules.embedding.zch.exchange import Exchange
    from pipeline.runtime.peers import Peers
    from pipeline.runtime.signals import PreemptionConfig, SignalGuard
    from pipeline.training.link_choice import slowest
    from pipeline.training.nonfinite import NonFiniteGuard

    with pytest.raises(RuntimeError, match=re.escape(REFUSAL)):  # the stand-in refuses a host tensor, as NCCL does
        dist.all_reduce(torch.ones(1))
    host_collectives.start(timedelta(seconds=120))
    guard = SignalGuard(PreemptionConfig())
    guard.signum = signal.SIGTERM if rank == 1 else None
    assert guard.agreed()  # every rank stops when one got the signal
    loss = torch.tensor(float("nan") if rank == 0 else 0.5)
    assert NonFiniteGuard("skip").bad_loss(loss, 0)  # every rank skips when one saw a NaN
    assert slowest(float(rank + 1)) == float(world)
    peers = Peers.exchange()
    assert peers is not None and len(peers.addresses) == world
    exchange = Exchange([10, 10])
    assert exchange.largest(rank) == world - 1 and exchange.everyone(rank) == list(range(world))
    received, latest = exchange.to_owners([torch.tensor([rank, 10 + rank]), torch.tensor([20 + rank])], time=rank)
    assert latest == world - 1 and [t.tolist() for t in received] == ([[0, 10, 1, 11]] if rank == 0 else [[20, 21]])


def test_host_collectives_go_over_gloo_where_the_default_group_takes_device_tensors_only():
    run_workers(_host_collectives, 2, backend=DEVICE_ONLY)


@pytest.mark.parametrize("overrides, message", [
    (["data.preprocess.categorical=raw", "model.zch.rows=1000"], "model.zch with topology.compute_device=cuda"),
    (["optim.embedding_l2_scope=all", "optim.embedding_l2=1e-4"], "optim.embedding_l2_scope=all with topology.com"),
    (["topology.ssd.look_ahead=true"], "topology.ssd.look_ahead=true with topology.compute_device=cuda"),
    (["trainer.merging.k=4", "trainer.merging.tables=per_node"], "trainer.merging.tables=per_node with topology"),
    (["trainer.merging.k=4", "trainer.merging.overlap=2"], "trainer.merging.overlap=2 with topology.compute_dev"),
])
def test_what_does_not_run_on_cuda_yet_is_refused_before_any_work(overrides, message):
    run = parse_config(compose_config(["topology=1gpu", *overrides]))
    with pytest.raises(ConfigError, match=re.escape(message)):  # (the link's settings first: this machine has no GPU)
        check_link_settings(run)
        check_runnable(run)
    check_config(compose_config(["topology=cpu", *overrides]))  # the CPU runs them


def test_a_gpu_topology_on_a_machine_without_one_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        check_config(compose_config(["topology=1gpu"]))
    assert parse_config(compose_config(["topology=1gpu"])).topology.compute_device == "cuda"


def _key_value_tables_refused(rank: int, world: int) -> None:
    from modules.embedding.feature_spec import FeatureSpec
    from modules.models import ModelConfig, build_model
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.placement import PlacementError
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import SsdSpec, TopologySpec

    spec = FeatureSpec(("I1",), ("a", "b"), {"a": 10, "b": 7})
    net = build_model(ModelConfig(embedding_dim=8, mlp=[8], stack_tables=False), spec, device=torch.device("meta"))
    gpu = TopologySpec(compute_device="cuda", ranks_per_node=1, hbm_cap_gb=80, ddr_cap_gb=64,
                       ssd=SsdSpec(path="/nvme", cap_gb=100), table_overrides={"emb_a": {"tier": "ssd"}})
    with pytest.raises(PlacementError, match=r"tables \['emb_a'\] go to the ssd tier on CUDA"):
        shard_model(net, OptimizerSpec("rowwise_adagrad", 0.1), gpu, torch.device("cpu"))


def test_tables_on_the_gpu_ssd_tier_are_refused_before_the_model_is_built():
    """FBGEMM's KEY_VALUE tables have not run here: refused with what to use instead, not left to fail mid-run."""
    run_workers(_key_value_tables_refused, 1)
