"""Bad configuration stops before any work, with a message naming the key."""

from __future__ import annotations

import subprocess

import pytest

from pipeline.config_check import ConfigError, check_config
from tests.conftest import PYTHON, ROOT, compose_config, subprocess_env


def test_default_config_composes_and_passes():
    cfg = compose_config()
    check_config(cfg)
    assert {"data", "model", "optim", "topology", "trainer", "logger"} <= set(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["model.name=widefm"], "model.name='widefm' is not a known model"),
    (["model.embedding_dim=10"], "model.embedding_dim=10"),
    (["optim.embedding.name=lion"], "optim.embedding.name='lion'"),
    (["trainer.batch_size=0"], "trainer.batch_size=0"),
    (["trainer.precision=8"], "trainer.precision"),
    (["data=criteo_kaggle"], "data.path is missing"),
    (["data=criteo_kaggle", "data.path=/nonexistent/train.txt"], "data.path: /nonexistent/train.txt does not exist"),
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
    proc = subprocess.run([PYTHON, "-m", "pipeline.train", f"paths.cache_dir={cache}", *overrides],
                          cwd=tmp_path, env=subprocess_env(**env), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not cache.exists()
    assert not (tmp_path / "mlflow.db").exists()
