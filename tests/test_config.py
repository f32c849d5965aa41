"""Bad configuration stops before any work, with a message naming the key; the typed config is what
the YAML says."""

from __future__ import annotations

import subprocess

import pytest
import torch

from pipeline.config import RunConfig, check_runnable, parse_config
from pipeline.runtime.errors import ConfigError
from pipeline.training.link_choice import check_link_settings
from tests.conftest import PYTHON, compose_config, subprocess_env


def check_config(cfg) -> RunConfig:
    run = parse_config(cfg)
    check_runnable(run)
    check_link_settings(run)
    return run


def test_default_config_composes_into_typed_objects():
    run = check_config(compose_config())
    # values from conf/ reach the dataclasses (checked against the YAML files, not the defaults in code)
    assert (run.optim.embedding.name, run.optim.embedding.lr) == ("rowwise_adagrad", 0.01)
    assert run.optim.dense.betas == (0.9, 0.999) and run.model.mlp == [400, 400, 400]
    assert run.topology.name == "cpu" and run.topology.ddr_cap_gb == 16
    assert run.data.synthetic.rows == 1_000_000 and run.data.preprocess.split.test == 0.1
    # k and the precisions are chosen for the link (auto) and merge nothing until then
    assert run.trainer.merging.k == "auto" and not run.trainer.merging.enabled
    assert (run.trainer.comms.embedding_forward, run.trainer.comms.dense) == ("auto", "auto")
    assert run.trainer.collective_timeout_s == 600
    gpu = parse_config(compose_config(["topology=2x8gpu", "scaling=cowclip"]))
    assert gpu.topology.bandwidth_gbps.inter_node == 50 and gpu.topology.numa == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gpu.topology.ssd.cap_gb == 15360 and gpu.scaling.cowclip.enabled and gpu.scaling.warmup_epochs == 1


@pytest.mark.parametrize("yaml, message", [
    ("trainer:\n  batchsize: 8", "Key 'batchsize' not in 'TrainerConfig'"),
    ("model:\n  embeding_dim: 8", "Key 'embeding_dim' not in 'ModelConfig'"),
    ("scaling:\n  cowclip: {zetta: 1.0}", "Key 'zetta' not in 'CowClipConfig'"),
    ("trainer:\n  max_epochs: two", "Value 'two' of type 'str' could not be converted to Integer"),
])
def test_misspelt_keys_and_wrong_types_in_a_config_file_are_caught(tmp_path, yaml, message):
    """An experiment file in the user's own config folder (``--config-dir``) is checked against the schema."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\n" + yaml + "\n")
    with pytest.raises(Exception) as err:
        compose_config([f"hydra.searchpath=[file://{tmp_path}]", "+experiment=mine"])
    text = f"{err.value} {err.value.__cause__}"
    assert message in text, text


@pytest.mark.parametrize("overrides, message", [
    (["model.name=widefm"], "model.name='widefm' is not a known model"),
    (["model.embedding_dim=10"], "model.embedding_dim=10"),
    (["optim.embedding.name=lion"], "optim.embedding.name='lion'"),
    (["trainer.batch_size=0"], "trainer.batch_size=0"),
    (["trainer.precision=8"], "trainer.precision"),
    (["data=criteo_kaggle"], "data.path is missing"),
    (["data=criteo_kaggle", "data.path=/nonexistent/train.txt"], "data.path: /nonexistent/train.txt does not exist"),
    (["scaling.cowclip.floor=sqrt"], "scaling.cowclip.floor='sqrt'"),
    (["data.preprocess.split.method=shuffle"], "data.preprocess.split.method='shuffle'"),
    (["trainer.merging.k=4", "trainer.merging.k_intra=3"], "trainer.merging.k_intra=3"),
    (["trainer.merging.k=often"], "trainer.merging.k='often': expected an integer >= 1, null (no merging) or auto"),
    (["trainer.merging.k_intra=2"], "trainer.merging.k_intra=2: needs an integer k"),
    (["trainer.comms.embedding_backward=int8"], "trainer.comms.embedding_backward='int8'"),
    (["trainer.comms.dense=fp8"], "trainer.comms.dense='fp8'"),
    (["trainer.comms.embedding_backward=bf16"], "trainer.comms.embedding_backward=bf16: TorchRec sends bf16 as fp16 on CPU"),
    (["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s=0"),
    (["trainer.merging.tables=mirrored"], "trainer.merging.tables='mirrored'"),
    (["trainer.merging.overlap=4"], "trainer.merging.overlap=4 with k='auto'"),
    (["trainer.merging.overlap=9", "trainer.merging.k=8"], "trainer.merging.overlap=9 with k=8"),
    (["trainer.merging.overlap=4", "trainer.merging.k=8", "trainer.merging.k_intra=2"],
     "trainer.merging.overlap=4 with k=8, k_intra=2: a merge travels while at most the next k steps train"),
    (["trainer.merging.tables=replicated"], "trainer.merging.tables=replicated with k='auto'"),
    (["trainer.merging.tables=replicated", "trainer.merging.k=null"], "trainer.merging.tables=replicated with k=None"),
    (["trainer.merging.tables=replicated", "trainer.merging.k=4", "trainer.comms.embedding_forward=fp16"],
     "trainer.merging.tables=replicated with trainer.comms.embedding_forward=fp16: copies of the tables send no "
     "all-to-all"),
    (["trainer.merging.tables=per_node", "trainer.merging.k=4", "trainer.merging.k_intra=2"],
     "trainer.merging.tables=per_node with k=4, k_intra=2"),
    (["trainer.merging.tables=replicated", "trainer.merging.k=4", "optim.embedding_l2_scope=all", "optim.embedding_l2=1e-5"],
     "trainer.merging.tables=replicated with optim.embedding_l2_scope=all"),
    (["trainer.merging.tables=per_node", "trainer.merging.k=4", "optim.embedding.name=adam"],
     "trainer.merging.tables=per_node with optim.embedding.name=adam: not fused into FBGEMM's kernels on the CPU"),
    (["+topology.table_overrides.emb_C1.tier=disk"], "topology.table_overrides.emb_C1.tier='disk'"),
    (["model=deepfm", "+model.low_rank=8"], "model.low_rank=8: model 'deepfm' takes no 'low_rank'"),
    (["scaling.rule=cubic"], "scaling.rule='cubic'"),
    (["model.stack_tables=sometimes"], "model.stack_tables='sometimes': expected true, false or auto"),
    (["optim.embedding_l2_scope=every"], "optim.embedding_l2_scope='every'"),
    (["trainer.init_from_optimizer=moments", "trainer.init_from=x"], "trainer.init_from_optimizer='moments'"),
    (["optim.embedding.weight_decay=0.1"], "optim.embedding.weight_decay=0.1: FBGEMM's fused rowwise_adagrad ignores"),
])
def test_bad_values_name_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(compose_config(overrides))


def test_batch_size_must_divide_over_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="trainer.batch_size=4096 is not divisible by the world size 3"):
        check_config(compose_config())


@pytest.mark.parametrize("overrides, env, message", [
    (["model=widefm"], {}, "Could not find 'model/widefm'"),
    (["data=criteo_kaggle"], {}, "data.path is missing"),
])
def test_cli_stops_before_any_work(tmp_path, overrides, env, message):
    cache = tmp_path / "cache"
    proc = subprocess.run([PYTHON, "-m", "pipeline.commands.train", f"paths.cache_dir={cache}", *overrides],
                          cwd=tmp_path, env=subprocess_env(**env), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not cache.exists()
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fused_cpu_optimizers_ignore_weight_decay(name):
    """Why ``optim.embedding.weight_decay`` is refused for fused tables: FBGEMM's CPU kernels take the
    argument and a ``weight_decay_mode`` but update exactly as without them. Reference: one step on rows
    of ones, gradient 1 per pooled row; with L2 decay the gradient would be 1 + λ·w = 1.5 (SGD: Δw = −lr·1.5;
    Adagrad family: accumulator 1.5² = 2.25). If a release starts honouring it, this test fails: lift the
    refusal in pipeline.config.check_runnable then."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType, SplitTableBatchedEmbeddingBagsCodegen
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    optim = {"sgd": OptimType.EXACT_SGD, "adagrad": OptimType.EXACT_ADAGRAD,
             "rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD}[name]
    for mode in (WeightDecayMode.L2, WeightDecayMode.DECOUPLE):
        tbe = SplitTableBatchedEmbeddingBagsCodegen([(8, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=optim,
                                                    learning_rate=0.1, eps=1e-8, weight_decay=0.5, weight_decay_mode=mode)
        with torch.no_grad():
            tbe.weights_host.fill_(1.0)
        tbe(torch.tensor([1, 5]), torch.tensor([0, 1, 2])).sum().backward()
        weights = tbe.split_embedding_weights()[0]
        if name == "sgd":
            assert torch.allclose(weights[1], torch.full((4,), 0.9)), (mode, weights[1])  # decayed: 0.85
        else:
            accumulator = next(iter(tbe.get_optimizer_state()[0].values())).flatten()
            assert torch.allclose(accumulator[accumulator > 0], torch.tensor(1.0)), (mode, accumulator)  # decayed: 2.25


def test_look_ahead_is_refused_where_the_next_ids_are_not_known(small_overrides, monkeypatch):
    """topology.ssd.look_ahead=true (modules/embedding/ssd_tier/rows_ahead.py) needs one process and no model.zch."""
    ahead = [*small_overrides, "topology.ssd.look_ahead=true"]
    check_config(compose_config(ahead))  # one process: fine
    with pytest.raises(ConfigError, match=r"topology.ssd.look_ahead=true needs one process and no model.zch "
                                          r"\(here 1 process\(es\), model.zch\)"):
        check_config(compose_config([*ahead, "data.preprocess.categorical=raw", "model.zch.rows=100"]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"\(here 2 process\(es\)\)"):
        check_config(compose_config(ahead))


@pytest.mark.parametrize("override, line", [
    ("trainer.batchsize=1024", "trainer.batchsize is not a key of trainer; did you mean trainer.batch_size or "
                               "trainer.eval_batch_size? (trainer's keys: conf/trainer/default.yaml and `ctr train "
                               "--help`)"),
    ("+trainer.batchsize=1024", "trainer.batchsize is not a key of trainer; did you mean trainer.batch_size"),
    ("trainer.checkpoint.dirr=ckpt", "trainer.checkpoint.dirr is not a key of trainer.checkpoint; did you mean "
                                     "trainer.checkpoint.dir?"),
    ("trainer.batch_size=big", "trainer.batch_size=big: expected int"),
    ("model=deepfn", "Could not find 'model/deepfn'; available: dcn, dcnv2, deepfm, wide_deep"),
    ("seedd=3", "seedd is not a key of the config; did you mean seed?"),
])
def test_a_bad_key_or_value_is_one_line_naming_it_with_the_nearest_keys(capsys, override, line):
    """Hydra said these in 7 lines, and its own hint (+key=value) ran with the key ignored."""
    from pipeline.commands.overrides import check_overrides
    from pipeline.runtime.config_source import config_path

    with pytest.raises(SystemExit) as stop:
        check_overrides(config_path(), "config", [override])
    error, hint = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and error.startswith("Error (ConfigError): ") and line in error, error
    assert hint.startswith("Hint: ")


def test_the_command_stops_on_it_with_status_2_before_writing_anything(tmp_path):
    import subprocess

    from tests.conftest import PYTHON, subprocess_env
    proc = subprocess.run([PYTHON, "-m", "pipeline.commands.train", "+trainer.batchsize=1024",
                           f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 2, proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_plus_still_adds_keys_where_the_schema_takes_free_keys():
    """``+`` for a table's override (a mapping of free keys) and an experiment (a config group) still composes."""
    from pipeline.commands.overrides import check_overrides
    from pipeline.runtime.config_source import config_path

    check_overrides(config_path(), "config", ["+topology.table_overrides.emb_C3.tier=ssd",
                                              "+experiment=frappe_deepfm", "trainer.batch_size=1024"])


def test_every_hint_names_only_settings_that_exist():
    """Each user error's hint (printed under its one line) leads somewhere: every ``key=value`` it names composes in
    ``ctr train``'s config, and a missing column is not answered with a setting that skips rows (the same error
    followed) nor, in ctr predict, with a training key."""
    import re

    from modules.embedding.lookup_inputs import IdOutOfRangeError
    from modules.embedding.ssd_tier.path_lock import SsdPathInUseError
    from modules.sharding.placement import PlacementError
    from pipeline.commands.overrides import check_overrides
    from pipeline.runtime import errors
    from pipeline.runtime.config_source import config_path

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.UserError)]
    hints = {c.__name__: c.hint for c in [*classes, IdOutOfRangeError, SsdPathInUseError, PlacementError] if c.hint}
    assert len(hints) >= 8
    named = {k: re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+=[^\s),;]+)", h) for k, h in hints.items()}
    for error, settings in named.items():
        for setting in settings:
            value = setting.split("=", 1)[1]
            if "${" in value or "/" in value:  # an example path
                continue
            check_overrides(config_path(), "config", [setting])  # exits 2 naming it if it does not compose
    assert "bad_rows" not in errors.MissingColumnsError.hint
    assert not named["MissingColumnsError"] and "export" not in errors.MissingColumnsError.hint
