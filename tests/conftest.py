"""Shared fixtures: composed configs and a small synthetic store built once per session."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import settings

from pipeline.config import compose_config, register_configs  # noqa: F401  (compose_config: for the tests)
from pipeline.runtime.launch import free_port  # noqa: F401  (re-exported for the tests)
from pipeline.training.result import RunResult, read_result

ROOT = Path(__file__).resolve().parents[1]
# Real CTR samples live beside the checkout (../shared/data); CTR_SHARED_DATA overrides.
SHARED_DATA = Path(os.environ.get("CTR_SHARED_DATA", ROOT.parent / "shared" / "data"))
PYTHON = sys.executable
SMALL_ROWS = 100_000
register_configs()  # the schema conf/config.yaml starts from, as every command that composes it does
# CI draws the same fuzzed examples every run (a red CI must mean the change, not the draw); runs elsewhere draw anew
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
# The files that take longest, handed to the test workers first (seconds summed per file, `make test ARGS=
# --durations=0` on 2 cores, 2026-11-29: 200, 157, 110, 104, 101, 88, 84, 76, 67, 58). `make test` runs
# `--dist loadfile --no-loadscope-reorder`, which gives out files in collection order; xdist's default order (most
# tests first) started the long ones last, one worker finishing them while the other had nothing left.
LONGEST_FIRST = ["test_cluster.py", "test_checkpointing.py", "test_ssd_tier.py", "test_gpu_check.py", "test_zch.py",
                 "test_faults.py", "test_package.py", "test_incremental.py", "test_serve.py", "test_training.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the other files keep their order


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra})
    return env


def train_cli(args: list[str], run_dir: Path, launcher: list[str] | None = None, timeout: int = 600,
              check: bool = True, command: str = "train") -> tuple[subprocess.CompletedProcess, RunResult | None]:
    """``python -m pipeline.commands.<command> *args`` (under ``launcher``, e.g. torchrun's arguments) with its
    output folder at ``run_dir``; returns the process and the run's ``result.json`` (None if it wrote none)."""
    cmd = [PYTHON, *(launcher or []), "-m", f"pipeline.commands.{command}", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc, read_result(run_dir) if (run_dir / "result.json").is_file() else None


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store in ``folder``; can be killed and started
    again on the same port and store."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "MlflowServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(Path(PYTHON).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder}/server.db",
             "--artifacts-destination", str(self.folder / "art"), "--workers", "1"],
            cwd=self.folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.kill()
                    pytest.fail("mlflow server did not start")
                time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL the server and its workers (an outage, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


@contextlib.contextmanager
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[None]:
    """An exclusive lock the test workers share (their temporary folders' parent): what holds it runs alone."""
    with open(tmp_path_factory.getbasetemp().parent / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def small_overrides(cache_dir: Path) -> list[str]:
    """A small synthetic dataset (prepared once) and a quick training setup."""
    from pipeline.config import parse_config
    from pipeline.data.sources import prepare_store

    overrides = [f"paths.cache_dir={cache_dir}", f"data.synthetic.rows={SMALL_ROWS}",
                 "trainer.batch_size=1024", "trainer.eval_batch_size=4096", "trainer.max_epochs=2",
                 "trainer.enable_progress_bar=false", "model.mlp=[64,32]",
                 "logger.log_model=false"]  # the model folder and MLflow model: tests/test_model_use.py
    cfg = parse_config(compose_config(overrides))
    prepare_store(cfg.data, cfg.paths.cache_dir)
    return overrides


@pytest.fixture(scope="module")
def ckpt_overrides(small_overrides):
    """The small setup at batch 4,096 (20 steps an epoch), 2 epochs, a checkpoint every 10 steps."""
    return [o for o in small_overrides if not o.startswith(("trainer.batch_size", "trainer.max_epochs"))] + \
        ["trainer.batch_size=4096", "trainer.max_epochs=2", "trainer.checkpoint.every_n_steps=10",
         "trainer.checkpoint.keep=5"]


def shared_file(relative: str) -> Path:
    """A file of the shared real-data samples; skips the test where the samples are not present."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"shared CTR sample {path} not present (set CTR_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def own_data_run(tmp_path_factory: pytest.TempPathFactory):
    """A run on a generated "own" click log declared in a YAML outside the repo (tests/click_logs.py):
    (folder, config folder, the run's arguments, its RunResult, the raw rows)."""
    from tests.click_logs import click_log, write_dataset

    folder = tmp_path_factory.mktemp("own")
    frame, p = click_log(40_000)
    frame.to_csv(folder / "log.csv", index=False)
    conf = write_dataset(folder / "conf").parent.parent
    args = ["--config-dir", str(conf), "data=mylog", f"data.path={folder / 'log.csv'}",
            f"paths.cache_dir={folder / 'cache'}", f"logger.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
            "trainer.batch_size=512", "trainer.max_epochs=3", "model.mlp=[32]", "model.embedding_dim=8",
            "trainer.enable_progress_bar=false", "topology.sharding_types=[table_wise]"]
    proc, result = train_cli([*args, "logger.register_model_as=mylog_ctr"], folder / "run")
    (folder / "run.log").write_text(proc.stdout + proc.stderr)  # what the user read (tests/test_own_data.py)
    return folder, conf, args, result, frame, p
