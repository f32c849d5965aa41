"""``model.table_precision`` (modules/embedding/table_precision.py): fp16 rows in FBGEMM's fused kernels, on 2 gloo
ranks, against the fp32 tables' step rounded to fp16; the planner's bytes; the settings refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modules.embedding.sparse_arch import FeatureSpec, SparseArch
from tests.dist_utils import run_workers

SPEC = FeatureSpec((), ("a", "b", "c"), {"a": 60, "b": 90, "c": 400})
DIM, BATCH = 8, 64


class Lookups(torch.nn.Module):
    def __init__(self, precision: str, device: torch.device | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(SPEC, DIM, init_std=0.3, wide=True, device=device, precision=precision)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        emb, first = self.sparse_arch(features)
        return torch.tanh(emb * torch.linspace(-1, 1, DIM)).sum((1, 2)) + (emb.sum(1) ** 2).sum(1) + first


def _step(rank: int, world: int, optimizer: str) -> None:
    """One training step of the same model from the same (fp16-exact) rows with fp32 and with fp16 tables, row-wise
    sharded over the ranks: every fp16 row is the fp32 row after the step, rounded to the nearest fp16 — FBGEMM's
    CPU kernels compute the update in fp32 from the fp16 row and round to nearest (no stochastic rounding); and the
    plan counts 2 bytes a value, the optimizer's state still 4."""
    from modules.optim.optimizers import OptimizerSpec
    from modules.sharding.planner import shard_model
    from modules.sharding.topology import TopologySpec
    from pipeline.data.batches import make_batch
    from pipeline.data.store import SplitArrays

    torch.manual_seed(0)
    rows = {k: v.normal_(0, 0.3).half().float() if ".embedding_bags." in k else v
            for k, v in Lookups("fp32").state_dict().items()}
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, n, BATCH) for n in SPEC.table_sizes.values()], 1).astype(np.int32)
    labels = rng.integers(0, 2, BATCH).astype(np.int8)
    mine = np.arange(rank * BATCH // world, (rank + 1) * BATCH // world)
    batch = make_batch(SplitArrays(labels, np.zeros((BATCH, 0), np.float32), ids), mine, list(SPEC.categorical))
    after, row_bytes = {}, {}
    for precision in ("fp32", "fp16"):
        topology = TopologySpec(compute_device="cpu", sharding_types=["row_wise"])
        dmp, plan = shard_model(Lookups(precision, torch.device("meta")), OptimizerSpec(optimizer, 0.05), topology,
                                torch.device("cpu"))
        dmp.load_state_dict(rows)
        F.binary_cross_entropy_with_logits(dmp(batch.dense_features, batch.sparse_features), batch.labels).backward()
        after[precision] = {k: v.local_shards()[0].tensor for k, v in dmp.state_dict().items() if hasattr(v, "local_shards")}
        row_bytes[precision] = {name: p.row_bytes for name, p in plan.placements.items()}
    for key, fp32 in after["fp32"].items():
        fp16 = after["fp16"][key]
        assert fp16.dtype == torch.float16 and fp32.dtype == torch.float32, key
        # the same gradient summed in another order may differ in fp32's last bits: at most one fp16 unit a value,
        # and rarely (stochastic rounding would move about half the values off the nearest)
        assert ((fp16.float() - fp32).abs() <= fp32.abs() * 2**-10 + 2**-24).all(), key
        assert (fp16 == fp32.half()).float().mean() >= 0.98, key
        assert not torch.equal(fp16.float(), fp32), key  # rounding happened: the tables are not fp32 in disguise
    state = {"sgd": 0, "rowwise_adagrad": 4}[optimizer]  # the optimizer's bytes a row stay fp32
    for name, fp32_bytes in row_bytes["fp32"].items():
        dim = DIM if name.startswith("emb_") else 4
        assert (fp32_bytes, row_bytes["fp16"][name]) == (4 * dim + state, 2 * dim + state), name


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_fp16_rows_are_the_fp32_step_rounded_to_nearest(optimizer):
    run_workers(_step, 2, optimizer)


@pytest.mark.parametrize("overrides, message", [
    (["model.table_precision=bf16"], "FBGEMM's CPU kernels have no bf16 tables"),
    (["model.table_precision=fp16", "optim.embedding.name=adam"], "half-precision rows need FBGEMM's fused update"),
    (["model.table_precision=fp8"], "model.table_precision='fp8': expected one of fp32, fp16, bf16"),
])
def test_settings_it_cannot_honour_are_refused_by_name(overrides, message):
    from pipeline.config import check_runnable, compose_run_config
    from pipeline.runtime.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message):
        check_runnable(compose_run_config(["data.synthetic.rows=1000", *overrides]))


def test_half_precision_rows_on_a_gpu_topology_are_planned_at_their_bytes_and_fit_where_fp32_does_not():
    """Dim 1,024 row-wise Adagrad on one GPU: in fp32 a table has to go behind a UVM cache; in fp16 — and bf16, which
    CUDA runs (refused on the CPU alone) — every table fits the GPU, each at rows · (2·dim + 4) bytes."""
    from pipeline.commands.plan import plan_for_config
    from tests.test_placement import compose_config

    tiers, mib = {}, {}
    for precision in ("fp32", "fp16", "bf16"):
        out = plan_for_config(compose_config(["topology=1gpu", "data=criteo_kaggle_shape", "model.embedding_dim=1024",
                                              f"model.table_precision={precision}"]))
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| emb_")]
        tiers[precision] = {r[0]: r[5] for r in rows}
        mib[precision] = {r[0]: (int(r[1].replace(",", "")), float(r[3].removesuffix(" MiB").replace(",", "")))
                          for r in rows}
        assert f"rows in {precision}" in out
    assert "uvm_cache" in tiers["fp32"].values()
    assert set(tiers["fp16"].values()) == set(tiers["bf16"].values()) == {"hbm"}
    for precision, value_bytes in (("fp32", 4), ("fp16", 2), ("bf16", 2)):
        for name, (rows, shown) in mib[precision].items():
            assert abs(shown - rows * (value_bytes * 1024 + 4) / 2**20) <= 0.06, (precision, name)
