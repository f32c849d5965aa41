"""Tier placement from topologies, the plan command, and NUMA binding (no GPU needed)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from modules.sharding.placement import PlacementError, TableInfo, place_tables
from modules.sharding.table_stacking import stacking_blocker
from modules.sharding.topology import GB, SsdSpec, TopologySpec
from modules.zipf import zipf_coverage
from pipeline.commands.plan import plan_for_config
from pipeline.runtime.numa import bind_to_gpu_numa_node, gpu_numa_node, node_cpus, parse_cpulist
from tests.conftest import PYTHON, ROOT, compose_config, subprocess_env

MB = 2**20


def _gpu(hbm_gb: float, ddr_gb: float = 64, ssd_gb: float = 0, gpus: int = 1, overrides: dict | None = None
         ) -> TopologySpec:
    return TopologySpec(name="t", compute_device="cuda", nodes=1, ranks_per_node=gpus, hbm_cap_gb=hbm_gb,
                        ddr_cap_gb=ddr_gb, ssd=SsdSpec(cap_gb=ssd_gb), hbm_reserve=0.0, ddr_reserve=0.0,
                        cache_coverage=0.9, table_overrides=overrides or {})


def _tables() -> list[TableInfo]:
    # sgd: 4 bytes per value; big = 1 GiB, mid = 256 MiB, small = 1 MiB
    return [TableInfo("big", 2**26, 4, {0.5: 2**18, 0.9: 2**21, 0.99: 2**24}),
            TableInfo("mid", 2**24, 4, {0.9: 2**20}),
            TableInfo("small", 2**16, 4)]


def test_everything_fits_in_gpu_memory():
    place = place_tables(_tables(), _gpu(hbm_gb=2), "sgd")
    assert {p.tier for p in place.values()} == {"hbm"}
    assert {p.kernel for p in place.values()} == {"fused"}
    assert place["big"].bytes == 1 * GB and place["mid"].bytes == 256 * MB


def test_gpu_memory_too_small_moves_the_largest_table_to_uvm_with_a_statistics_sized_cache():
    place = place_tables(_tables(), _gpu(hbm_gb=0.5), "sgd")
    assert place["big"].tier == "uvm_cache" and place["big"].kernel == "fused_uvm_caching"
    assert place["big"].cache_load_factor == pytest.approx(2**21 / 2**26)  # rows carrying 90 % / rows
    assert place["mid"].tier == "hbm" and place["small"].tier == "hbm"
    assert sum(p.hbm_bytes for p in place.values()) <= 0.5 * GB


def test_host_memory_too_small_moves_tables_to_ssd():
    place = place_tables(_tables(), _gpu(hbm_gb=0.2, ddr_gb=0.5, ssd_gb=10), "sgd")
    assert place["big"].tier == "ssd" and place["big"].kernel == "key_value"
    assert place["mid"].tier == "uvm_cache"
    assert place["small"].tier == "hbm"


def test_override_is_respected():
    overrides = {"small": {"tier": "uvm_cache", "cache_load_factor": 0.5}, "mid": {"compute_kernel": "key_value"}}
    place = place_tables(_tables(), _gpu(hbm_gb=2, ssd_gb=1, overrides=overrides), "sgd")
    assert (place["small"].tier, place["small"].cache_load_factor) == ("uvm_cache", 0.5)
    assert place["mid"].tier == "ssd" and place["big"].tier == "hbm"


def test_optimizer_state_counts():
    t = TableInfo("t", 1000, 8)
    assert (t.bytes("sgd"), t.bytes("rowwise_adagrad"), t.bytes("adagrad"), t.bytes("adam")) == \
        (32_000, 36_000, 64_000, 96_000)


def test_impossible_fit_gives_the_numbers():
    with pytest.raises(PlacementError) as err:
        place_tables(_tables(), _gpu(hbm_gb=0.01, ddr_gb=0.1, ssd_gb=0.2), "adam")
    msg = str(err.value)
    assert "do not fit topology 't'" in msg and "largest big 3.0 GB" in msg
    assert "host: needs" in msg and "ssd: needs" in msg


def test_zipf_coverage_is_monotone_and_bounded():
    cov = zipf_coverage(10_000_000, 1.1)
    values = [cov[q] for q in sorted(cov)]
    assert values == sorted(values) and 1 <= values[0] and values[-1] <= 10_000_000
    assert cov[0.5] < 1000  # half the traffic on a few hundred ids: a small cache serves it


def test_shared_first_order_table_sums_the_fields_coverage():
    """One ``wide`` table holds every field's rows: the rows covering q of its lookups add up per field."""
    from torchrec import EmbeddingBagCollection

    from modules.embedding.sparse_arch import FeatureSpec, table_configs
    from modules.sharding.planner import table_infos

    spec = FeatureSpec((), ("a", "b"), {"a": 1000, "b": 50})
    ebc = EmbeddingBagCollection(tables=table_configs(spec, 8, 0.01, wide=True), device=torch.device("meta"))
    cov = {"a": {0.5: 10, 0.9: 300, 0.99: 900}, "b": {0.5: 2, 0.9: 20}}
    infos = {t.name: t for t in table_infos(ebc, cov)}
    assert infos["emb_a"].coverage_rows == cov["a"] and infos["emb_b"].coverage_rows == cov["b"]
    assert (infos["wide"].rows, infos["wide"].coverage_rows) == (1050, {0.5: 12, 0.9: 320})
    assert table_infos(ebc, {"a": cov["a"]})[-1].coverage_rows == {}  # a field without statistics: none
    with pytest.raises(ValueError, match="wide_x.*reserved"):
        table_configs(FeatureSpec((), ("wide_x",), {"wide_x": 3}), 8, 0.01, wide=True)


def test_cpu_topology_keeps_tables_in_host_memory():
    spec = TopologySpec(name="cpu", compute_device="cpu")
    assert {p.tier for p in place_tables(_tables(), spec, "rowwise_adagrad").values()} == {"host"}
    assert {p.kernel for p in place_tables(_tables(), spec, "adam", fusable=False).values()} == {"dense"}


def test_stacking_only_where_the_tables_would_share_tier_and_rank_anyway(tmp_path):
    names = [t.name for t in _tables()]

    def why(topology: TopologySpec) -> str | None:
        return stacking_blocker(place_tables(_tables(), topology, "sgd"), names, topology)

    cpu = TopologySpec(name="cpu", compute_device="cpu")
    assert why(cpu) is None
    assert "GPU" in why(_gpu(hbm_gb=80))
    assert "'small'" in why(TopologySpec(compute_device="cpu", table_overrides={"small": {"tier": "host"}}))
    # 1 GiB of host memory: the largest table goes to the ssd tier's files
    small_host = TopologySpec(compute_device="cpu", ddr_cap_gb=1, ddr_reserve=0.0, ssd=SsdSpec(path=str(tmp_path)))
    assert why(small_host) == "the tables are placed on host and ssd"
    two = TopologySpec(compute_device="cpu", ranks_per_node=2)
    assert "2 ranks" in why(two)
    assert why(TopologySpec(compute_device="cpu", ranks_per_node=2, sharding_types=["table_wise", "row_wise"])) is None


def test_plan_command_stacks_the_cpu_tables_unless_one_is_forced():
    def emb_rows(overrides: list[str]) -> list[str]:
        out = plan_for_config(compose_config(["topology=cpu", "data=criteo_kaggle_shape", *overrides]))
        return [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| emb_")
                or line.startswith("| stacked")]

    assert emb_rows([]) == ["stacked"]
    assert len(emb_rows(["+topology.table_overrides.emb_C3.tier=host"])) == 26
    assert len(emb_rows(["model.stack_tables=false"])) == 26


def test_plan_command_shows_a_copy_per_node_planned_over_the_node_s_ranks(small_overrides):
    """2 nodes x 2 ranks with a 100 Mbit/s link stated: the tables get a copy per node (link_plan), and the plan shown
    is the one each node's copy is sharded by, over its 2 ranks."""
    out = plan_for_config(compose_config([*small_overrides, "topology.nodes=2", "topology.ranks_per_node=2",
                                          "topology.bandwidth_gbps.inter_node=0.0125"]))
    assert "the tables planned over one copy's 2 rank(s) (trainer.merging.tables=per_node)" in out
    ranks = {line.split("|")[-2].strip() for line in out.splitlines() if line.startswith(("| emb_", "| wide"))}
    assert ranks == {"0", "1"}, ranks
    assert "every table on every node, sharded over its 2 ranks" in out
    # trainer.batch_size is global: each of the 4 ranks trains a quarter, a kernel of a node's copy sees its node's half
    assert "; batch 1,024 (256 a rank; a table-wise kernel sees 512)" in out


def test_the_batch_size_is_global_whatever_the_world_size():
    """One reading of ``trainer.batch_size`` (global, split over the ranks) in the plan, as the loader splits it."""
    def title(ranks: int) -> str:
        out = plan_for_config(compose_config(["topology=cpu", "data=criteo_kaggle_shape", "trainer.batch_size=4096",
                                              "trainer.eval_batch_size=8192", f"topology.ranks_per_node={ranks}"]))
        return out.splitlines()[0]

    assert title(1).endswith("; batch 4,096 (4,096 a rank; a table-wise kernel sees 4,096)")
    assert title(4).endswith("; batch 4,096 (1,024 a rank; a table-wise kernel sees 4,096)")


def test_plan_command_for_criteo_shaped_tables_on_an_8gpu_node():
    proc = subprocess.run([PYTHON, "-m", "pipeline.commands.plan", "topology=8gpu_node", "data=criteo_kaggle_shape"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| table | rows | dim | bytes | sharding | tier | kernel | cache load factor | row cache | ranks |" in out
    assert "| emb_C3 | 10,131,229 | 16 |" in out and out.count("| emb_C") == 26 and out.count("| wide |") == 1
    assert "| rank | HBM GiB | host DDR GiB | SSD GiB |" in out and "\n| 7 |" in out


def test_plan_on_one_gpu_uses_every_tier_and_counts_optimizer_state():
    """Dim 512 with Adam (~195 GiB) on one 140 GiB GPU: big tables to UVM caching, a forced one to SSD (planned)."""
    out = plan_for_config(compose_config(["topology=1gpu", "data=criteo_kaggle_shape", "model.embedding_dim=512",
                                          "optim=reference", "+topology.table_overrides.emb_C12.tier=ssd"]))
    rows = {cells[0]: cells for line in out.splitlines() if line.startswith("| emb_")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    mib = {name: float(c[3].removesuffix(" MiB").replace(",", "")) for name, c in rows.items()}
    assert rows["emb_C12"][5:7] == ["ssd", "key_value"]
    uvm = [name for name, c in rows.items() if c[5] == "uvm_cache"]
    assert "emb_C3" in uvm and all(0 < float(rows[n][7]) < 1 for n in uvm)
    rank0 = next(line for line in out.splitlines() if line.startswith("| 0 |"))
    hbm, ddr, ssd = (float(x) for x in rank0.strip("|").split("|")[1:4])
    # TorchRec's estimates per tier include Adam's two moments (3× the weights), as the table's bytes do
    assert ssd * 1024 >= 0.95 * mib["emb_C12"]
    assert ddr * 1024 >= 0.95 * sum(mib[n] for n in uvm)
    assert hbm * 1024 >= 0.95 * sum(m for n, m in mib.items() if rows[n][5] == "hbm")
    assert hbm <= 140


def test_plan_refuses_an_impossible_model():
    cfg = compose_config(["topology=1gpu", "data=criteo_kaggle_shape", "model.embedding_dim=65536", "optim=reference"])
    with pytest.raises(PlacementError, match="do not fit topology '1gpu'"):
        plan_for_config(cfg)


def test_numa_lookup_from_sysfs(tmp_path):
    dev = tmp_path / "bus" / "pci" / "devices" / "0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    node = tmp_path / "devices" / "system" / "node" / "node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("16-19,48\n")
    assert gpu_numa_node("0000:1B:00.0", tmp_path) == 1
    assert node_cpus(1, tmp_path) == {16, 17, 18, 19, 48}
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}


def test_numa_binding_does_nothing_without_cuda():
    before = os.sched_getaffinity(0)
    assert bind_to_gpu_numa_node(0, numa=[0], cuda_available=False) is None
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "topology").glob("*.yaml")))
def test_every_topology_config_composes_into_a_spec(name):
    from pipeline.config import parse_config

    spec = parse_config(compose_config([f"topology={name}"])).topology
    assert spec.name == name and spec.nodes >= 1
    if spec.compute_device == "cuda":
        assert spec.hbm_cap_gb > 0 and (spec.numa is None or len(spec.numa) == spec.ranks_per_node)  # None: from /sys
        bw = spec.bandwidth_gbps
        assert None not in (bw.hbm, bw.host_link, bw.intra_node, bw.inter_node)
