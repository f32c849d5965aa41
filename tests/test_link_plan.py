"""The link plan (modules/sharding/link_plan.py): bytes per option from the step's shape, and the choice."""

from __future__ import annotations

import pytest

from modules.sharding.link_plan import DEFAULT, LinkOption, PassRows, StepShape, choose, link_bytes

# DeepFM on the synthetic log: 26 one-id features of dim 16, 13 dense, MLP 400-400-400; batch 4,096 on 2 nodes
SHAPE = StepShape(local_batch=2048, pooled_width=26 * 16, ids_per_sample=26, dense_params=493_000, world=2,
                  ranks_per_node=1)


def test_bytes_follow_the_precision_and_the_merge_period():
    fp32, half = link_bytes(SHAPE, DEFAULT), link_bytes(SHAPE, LinkOption(None, "fp16", "bf16", "fp16"))
    ids = SHAPE.local_batch * 0.5 * SHAPE.ids_per_sample * 12  # int64 id + int32 length, half to the other node
    assert half["embedding"] - ids == pytest.approx((fp32["embedding"] - ids) / 2)
    assert half["dense"] == pytest.approx(fp32["dense"] / 2)
    assert fp32["dense"] == pytest.approx(SHAPE.dense_params * 4)  # a ring all-reduce over 2 ranks: once each way
    assert link_bytes(SHAPE, LinkOption(8, "fp32", "fp32", "fp32"))["dense"] == pytest.approx(fp32["dense"] / 8)
    one_node = StepShape(2048, 416, 26, 493_000, world=2, ranks_per_node=2)
    assert sum(link_bytes(one_node, DEFAULT).values()) == 0


@pytest.mark.parametrize("shape, link, why", [
    (StepShape(2048, 416, 26, 493_000, world=2, ranks_per_node=2), 0.0125, "one node"),
    (SHAPE, None, "no inter-node bandwidth stated"),
    (SHAPE, 50.0, "less than 10% to gain"),  # 400 Gbit/s InfiniBand beside a 40 ms step
])
def test_one_node_no_link_or_a_fast_link_keep_ddp_in_fp32(shape, link, why):
    choice = choose(shape, link, compute_s=0.04)
    assert choice.option == DEFAULT and why in choice.reason


def test_a_slow_link_takes_the_option_of_least_estimated_time():
    choice = choose(SHAPE, 0.0125, compute_s=0.04)  # 100 Mbit/s
    assert choice.option != DEFAULT and choice.step_s <= 0.9 * choice.default_step_s
    estimates = {o: 0.04 + sum(link_bytes(SHAPE, o).values()) / 0.0125e9
                 for o in [LinkOption(k, f, b, d) for k in (None, 2, 4, 8) for f, b in (("fp32", "fp32"), ("fp16", "bf16"))
                           for d in ("fp32", "fp16")]}
    assert choice.step_s == pytest.approx(min(estimates.values()))


def test_values_set_by_the_user_are_chosen_around():
    """trainer.merging.k=null with the precisions at auto: the fastest DDP option, its dense all-reduce included."""
    choice = choose(SHAPE, 0.0125, compute_s=0.04, fixed={"k": None})
    assert choice.option == LinkOption(None, "fp16", "bf16", "fp16")
    fp32_embeddings = choose(SHAPE, 0.0125, compute_s=0.04, fixed={"embedding_forward": "fp32"})
    assert fp32_embeddings.option.embedding_forward == "fp32" and fp32_embeddings.option.k == 8


# what a pass of k local batches of 2,048 met on the synthetic log (distinct rows, one rank / both ranks)
ROWS = PassRows(local={2: 17_000, 4: 30_000, 8: 50_000}, union={2: 30_000, 4: 50_000, 8: 85_000}, row_floats=17.0)


def test_replicated_tables_send_the_rows_a_pass_met_not_the_pooled_vectors():
    shape = StepShape(2048, 416, 26, 493_000, world=2, ranks_per_node=1, pass_rows=ROWS)
    sent = link_bytes(shape, LinkOption(8, "fp32", "fp32", "fp32", "replicated"))
    # half the ring's hops leave the node: the int32 ids, then each rank's own 50,000 rows' updates all-gathered
    # (2 copies: fewer than the union's 85,000 rows and a count all-reduced, whose ring moves them twice)
    assert sent["embedding"] == pytest.approx(0.5 * (4 * 50_000 + 4 * 2 * 50_000 * 17.0) / 8)
    assert sent["dense"] == link_bytes(shape, LinkOption(8, "fp32", "fp32", "fp32"))["dense"]
    half = link_bytes(shape, LinkOption(8, "fp32", "fp16", "fp32", "replicated"))["embedding"]
    assert half == pytest.approx(0.5 * (4 * 50_000 + 2 * 2 * 50_000 * 17.0) / 8)
    # 8 copies meeting the same rows: the union's updates all-reduced are the fewer bytes
    same = PassRows(local=ROWS.union, union=ROWS.union, row_floats=17.0)
    many = StepShape(2048, 416, 26, 493_000, world=8, ranks_per_node=1, pass_rows=same)
    assert link_bytes(many, LinkOption(8, "fp32", "fp32", "fp32", "replicated"))["embedding"] == pytest.approx(
        7 / 8 * (4 * 85_000 + 4 * 2 * 85_000 * (17.0 + 1)) / 8)
    choice = choose(shape, 0.0125, compute_s=0.04)
    assert choice.option == LinkOption(8, "fp32", "fp16", "fp16", "replicated")  # the least bytes here
    # without the pass rows (tables that do not fit, every-row L2, model.zch) only sharded options are open
    assert choose(SHAPE, 0.0125, compute_s=0.04).option.tables == "sharded"
    assert choose(shape, 0.0125, compute_s=0.04, fixed={"tables": "sharded"}).option.tables == "sharded"


def test_copies_per_node_send_each_shard_of_a_node_pass_once_across_the_link():
    rows = PassRows(local=ROWS.local, union=ROWS.union, row_floats=17.0, node={2: 25_000, 4: 42_000, 8: 70_000})
    shape = StepShape(2048, 416, 26, 493_000, world=4, ranks_per_node=2, pass_rows=rows)
    per_node = link_bytes(shape, LinkOption(8, "fp32", "fp32", "fp32", "per_node"))
    # 2 nodes: each rank exchanges its shard's half of the node's rows with its peer on the other node
    assert per_node["embedding"] == pytest.approx(0.5 * (4 * 70_000 + 4 * 2 * 70_000 * 17.0) / (8 * 2))
    replicated = link_bytes(shape, LinkOption(8, "fp32", "fp32", "fp32", "replicated"))
    assert per_node["dense"] == replicated["dense"] and per_node["embedding"] < 0.6 * replicated["embedding"]
    assert choose(shape, 0.0125, compute_s=0.04).option.tables == "per_node"
    # one rank a node: a node's copy is a rank's, the same bytes; replicated (listed first) is what is chosen
    one = StepShape(2048, 416, 26, 493_000, world=2, ranks_per_node=1, pass_rows=ROWS)
    assert link_bytes(one, LinkOption(8, "fp32", "fp32", "fp32", "per_node")) == pytest.approx(
        link_bytes(one, LinkOption(8, "fp32", "fp32", "fp32", "replicated")))
    assert choose(one, 0.0125, compute_s=0.04).option.tables == "replicated"


def test_pass_rows_count_distinct_rows_of_each_table():
    import numpy as np

    from modules.embedding.feature_spec import FeatureSpec
    from pipeline.data.store import SplitArrays
    from pipeline.training.link_choice import pass_rows

    spec = FeatureSpec(("I1",), ("a", "b"), {"a": 50, "b": 30})
    rng = np.random.default_rng(0)
    n = 8 * 16 * 2  # every row sampled: the largest pass of both ranks is the whole split
    sparse = np.stack([rng.integers(0, 50, n), rng.integers(0, 30, n)], 1).astype(np.int32)
    split = SplitArrays(np.zeros(n, np.int8), np.zeros((n, 1), np.float32), sparse)
    rows = pass_rows(split, spec, local_batch=16, world=2, row_floats=5.0, ranks_per_node=2)
    assert rows.union[8] == len({("a", x) for x in sparse[:, 0]} | {("b", x) for x in sparse[:, 1]})
    assert rows.local[2] < rows.local[4] < rows.local[8] <= rows.union[8] and rows.local[2] < rows.union[2]
    assert rows.node == rows.union  # one node holds both ranks
    assert rows.row_floats == 5.0


@pytest.mark.parametrize("nodes, link, k, overlap, want", [
    (2, 0.0125, "auto", "auto", "late"),  # merging chosen for a slow link: each merge lands LATE_STEPS steps late
    (2, 0.0125, 8, "auto", "late"),       # k set by the user, the link stated: the same
    (2, 0.0125, 8, 0, 0),            # set by the user: kept
    (2, None, 8, "auto", 0),         # no link stated: merges block, as before
    (1, 0.0125, 8, "auto", 0),       # one node: nothing crosses a link
])
def test_overlap_at_auto_lands_merges_late_only_over_a_stated_link(nodes, link, k, overlap, want):
    from modules.embedding.sparse_arch import FeatureSpec
    from modules.models import ModelConfig
    from modules.optim.kstep_merging import MergeConfig
    from modules.sharding.comm_precision import CommsConfig
    from modules.sharding.link_plan import LATE_STEPS
    from modules.sharding.topology import Bandwidths, TopologySpec
    from pipeline.training.link_choice import resolve_link

    spec = FeatureSpec(("I1",), ("a", "b"), {"a": 1000, "b": 500})
    topology = TopologySpec(compute_device="cpu", nodes=nodes, ranks_per_node=2 // nodes,
                            bandwidth_gbps=Bandwidths(inter_node=link))
    merging, _, _ = resolve_link(MergeConfig(k=k, overlap=overlap), CommsConfig(), ModelConfig(mlp=[64]), spec,
                                 topology, local_batch=2048, dense_params=500_000)
    assert merging.k is not None and merging.overlap == (min(LATE_STEPS, merging.k) if want == "late" else want)


def test_copies_are_offered_only_where_the_memory_holds_them():
    """A copy per rank needs every table (and its optimizer state) on each rank, a copy per node a node's share: with
    room for the second only, the choice never takes the first, and asking for it explicitly is refused."""
    import torch

    from modules.embedding.sparse_arch import FeatureSpec
    from modules.models import ModelConfig, build_model
    from modules.optim.kstep_merging import MergeConfig
    from modules.sharding.topology import GB, TopologySpec
    from pipeline.training.link_choice import copies_that_fit, memory_refusal

    net = build_model(ModelConfig(embedding_dim=16, mlp=[8], stack_tables=False),
                      FeatureSpec(("I1",), ("a",), {"a": 1_000_000}), device=torch.device("meta"))
    tables = 1_000_000 * (16 + 4) * 4  # the emb and first-order rows, fp32
    def on(ddr_bytes: float) -> TopologySpec:  # 2 nodes × 4 ranks, no reserve: each rank gets a quarter
        return TopologySpec(compute_device="cpu", nodes=2, ranks_per_node=4, ddr_cap_gb=ddr_bytes / GB, ddr_reserve=0)

    assert copies_that_fit(net, on(4 * 2 * tables)) == ("replicated", "per_node")
    assert copies_that_fit(net, on(4 * 2 * tables * 0.9)) == ("per_node",)  # 2·T/4 per rank fits, 2·T does not
    assert copies_that_fit(net, on(2 * tables * 0.9)) == ()
    assert copies_that_fit(net, TopologySpec(compute_device="cpu", nodes=2, ranks_per_node=4)) == \
        ("replicated", "per_node")  # no capacity stated
    why = memory_refusal(MergeConfig(k=4, tables="replicated"), net, on(4 * 2 * tables * 0.9))
    assert why is not None and why.startswith("trainer.merging.tables=replicated: each rank would hold 0.15 GB")
    assert memory_refusal(MergeConfig(k=4, tables="per_node"), net, on(4 * 2 * tables * 0.9)) is None
    from modules.sharding.link_plan import MERGE_PERIODS, options
    assert {o.tables for o in options("fp16", ("per_node",))} == {"sharded", "per_node"}
    rows = PassRows({k: 500 * k for k in MERGE_PERIODS[1:]}, {k: 2000 * k for k in MERGE_PERIODS[1:]}, 17.0,
                    {k: 1000 * k for k in MERGE_PERIODS[1:]})
    shape = StepShape(4096, 26 * 16, 26, 500_000, world=8, ranks_per_node=4, pass_rows=rows, copies=("per_node",))
    assert choose(shape, 0.0125, 0.05).option.tables != "replicated"


def test_a_resumed_run_takes_the_link_settings_its_checkpoint_ran_with():
    """The choice ``auto`` made (from a measured time) is recorded in the checkpoint and taken back as it was — over
    the resumed run's topology (a copy per node spans a node's ranks); an explicit value that differs is refused."""
    from modules.sharding.topology import TopologySpec
    from pipeline.config import compose_run_config
    from pipeline.runtime.errors import ConfigError
    from pipeline.training.link_choice import LinkSettings

    ran = LinkSettings.of(compose_run_config(["trainer.merging.k=8", "trainer.merging.tables=per_node",
                                               "trainer.merging.overlap=2", "trainer.comms.embedding_backward=fp16"]))
    topology = TopologySpec(compute_device="cpu", nodes=2, ranks_per_node=2)
    recorded = ran.record()
    resumed = LinkSettings.of(compose_run_config([])).as_recorded(recorded, topology)  # everything at auto
    assert resumed.record() == recorded and resumed.copy_span == 2 and resumed.merging.overlap == 2
    with pytest.raises(ConfigError, match=r"trainer\.merging\.k=4: the checkpoint being resumed ran with 8"):
        LinkSettings.of(compose_run_config(["trainer.merging.k=4"])).as_recorded(recorded, topology)


def test_one_node_prints_no_estimate_of_a_link_it_does_not_cross():
    """``Estimated step 0.000 s against 0.000 s`` was printed where nothing was estimated."""
    from modules.optim.kstep_merging import MergeConfig
    from modules.sharding.comm_precision import CommsConfig
    from pipeline.training.link_choice import LinkSettings
    from modules.sharding.link_plan import DEFAULT, LinkChoice

    nothing = LinkChoice(DEFAULT, 0.0, 0.0, 0.0, 0.0, "one node")
    line = LinkSettings(MergeConfig(k=None, overlap=0), CommsConfig("fp32", "fp32", "fp32"), nothing).describe()
    assert line.startswith("link: DDP (every step)") and "Estimated" not in line
    some = LinkChoice(DEFAULT, 0.2, 0.5, 0.1, 1e6, "a 100 Mbit/s link")
    assert "Estimated step 0.200 s against 0.500 s" in LinkSettings(MergeConfig(), CommsConfig("fp32", "fp32", "fp32"),
                                                                     some).describe()
