"""Faults, measured: tracking-server outages, damaged checkpoints, full disks, user errors without
tracebacks (docs/failure_behaviour.md). Fuzzed input files are in test_fuzz_readers.py."""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.runtime.launch import free_port
from pipeline.tracking.logger import FALLBACK_DB, ORIGINAL_RUN_TAG
from tests.conftest import PYTHON, ROOT, MlflowServer, subprocess_env, train_cli

# the whole command: imports (7-10 s alone, more beside another test on 2 cores: make test runs two at once) and
# the probe's logger.connect_timeout_s (5 s); without the probe MLflow's client retries for minutes
FAIL_FAST_S = 40


def _train(args: list[str], run_dir: Path, check: bool = True):
    return train_cli([*args, "trainer.enable_progress_bar=false"], run_dir, check=check)


def test_unreachable_tracking_server_fails_fast_with_one_line(small_overrides, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    proc, result = _train([*small_overrides, f"paths.cache_dir={cache}", f"logger.tracking_uri={uri}"],
                          tmp_path / "run", check=False)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2 and result is None, proc.stderr[-3000:]
    assert f"Error (TrackingUnavailableError): logger.tracking_uri={uri}: no MLflow tracking server answered" \
        in proc.stderr and "Hint: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not cache.exists()  # stopped before any data work
    assert seconds < FAIL_FAST_S, f"took {seconds:.1f} s"
    print(f"unreachable tracking server: failed in {seconds:.1f} s (whole command)")


def test_on_unavailable_local_logs_to_the_output_folder(small_overrides, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    proc, result = _train([*small_overrides, f"logger.tracking_uri={uri}", "logger.on_unavailable=local",
                           "trainer.max_steps=5", "trainer.max_epochs=1"], tmp_path / "run")
    local = f"sqlite:///{(tmp_path / 'run' / 'mlflow.db').resolve()}"
    assert f"logging to {local} instead" in proc.stdout
    run = MlflowClient(local).get_run(result.mlflow_run_id)
    assert abs(run.data.metrics["test/auc"] - result.test_auc) < 1e-9 and run.info.status == "FINISHED"


def _histories(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


# slow: 45 s; the fallback store and its replay to a real server: test_undelivered_logging_is_kept_locally_and_replays_to_the_server
@pytest.mark.slow
def test_tracking_server_killed_mid_run_and_restarted_loses_no_metric(small_overrides, tmp_path):
    """The same deterministic training twice: once with the server up, once with the server killed
    after the first metric and restarted 8 s later. The second run finishes, and the server (after
    replaying the fallback store, if anything went there) holds every metric value of the first."""
    args = [*small_overrides, "trainer.max_epochs=3", "trainer.log_every_n_steps=5", "logger.flush_timeout_s=20",
            "logger.retry_max_s=2"]
    with MlflowServer(tmp_path / "ref") as server:
        _, ref = _train([*args, f"logger.tracking_uri={server.uri}"], tmp_path / "ref_run")
        want = _histories(server.uri, ref.mlflow_run_id)

    server = MlflowServer(tmp_path / "srv").start()
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-m", "pipeline.commands.train", *args, "trainer.enable_progress_bar=false",
           f"logger.tracking_uri={server.uri}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        client = MlflowClient(server.uri)

        def has_loss() -> bool:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
            return any("train/loss" in r.data.metrics for r in runs)

        _wait_for(has_loss, 300, "the first train/loss on the server")
        server.kill()
        killed_at = time.time()
        time.sleep(8)
        server.start()
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    try:
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        result = (run_dir / "result.json").read_text()
        run_id = __import__("json").loads(result)["mlflow_run_id"]
        fallback = run_dir / FALLBACK_DB
        if fallback.exists():  # what the server missed within flush_timeout_s: replayed now
            sync = subprocess.run([PYTHON, "-m", "pipeline.commands.sync", f"source=sqlite:///{fallback}",
                                   f"target={server.uri}"], cwd=ROOT, env=subprocess_env(), capture_output=True,
                                  text=True, timeout=120)
            assert sync.returncode == 0, sync.stderr[-3000:]
            local = MlflowClient(f"sqlite:///{fallback}")
            kept = [r for e in local.search_experiments() for r in local.search_runs([e.experiment_id])]
            assert kept and all(r.data.tags[ORIGINAL_RUN_TAG] == run_id for r in kept)
        got = _histories(server.uri, run_id)
        timing = {k: v for k, v in got.items() if "samples_per_s" in k}  # wall-clock numbers differ per run
        assert set(timing) == {k for k in want if "samples_per_s" in k}
        for k in timing:
            assert [s for s, _ in got[k]] == [s for s, _ in want[k]], k
        same = {k: v for k, v in got.items() if k not in timing}
        assert same == {k: v for k, v in want.items() if k not in timing}
        assert MlflowClient(server.uri).get_run(run_id).info.status == "FINISHED"
        print(f"outage: server down {8:.0f} s from {killed_at:.0f}; {sum(map(len, same.values()))} metric values "
              f"all on the server (fallback used: {fallback.exists()})")
    finally:
        server.kill()


STORE_FULL = textwrap.dedent(r'''
    import resource, signal, sys
    from pathlib import Path
    from pipeline.data.dataset import builtin_layout
    from pipeline.data.preprocess import preprocess
    from pipeline.data.preprocess_config import PreprocessConfig
    from pipeline.runtime.errors import DiskFullError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
    try:
        preprocess([sys.argv[1]], builtin_layout("criteo", PreprocessConfig(min_count=1)), Path(sys.argv[2]))
    except DiskFullError as e:
        print(e.strerror)
        sys.exit(3)
''')


def test_full_disk_while_writing_the_store_names_path_and_bytes_and_leaves_nothing(tmp_path):
    from pipeline.data.synthetic import SyntheticConfig, generate

    raw = tmp_path / "raw.tsv"
    generate(SyntheticConfig(rows=20_000, seed=5), raw, progress=False)
    cache = tmp_path / "stores"
    cache.mkdir()
    earlier = cache / "earlier"
    earlier.mkdir()
    (earlier / "meta.json").write_text("{}")  # something already there must stay as it was
    proc = subprocess.run([PYTHON, "-c", STORE_FULL, str(raw), str(cache / "new"), str(200_000)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = proc.stdout.strip()
    assert str(cache / "new") in line and "no space left while writing" in line and "needs about" in line, line
    assert sorted(p.name for p in cache.iterdir()) == ["earlier"]  # no store, no scratch, no temporary folder
    assert (earlier / "meta.json").read_text() == "{}"


CHECKPOINT_FULL = textwrap.dedent(r'''
    import os, sys, torch, torch.distributed as dist
    from pipeline.checkpoint.dcp_io import DCPCheckpointIO
    from pipeline.checkpoint.training_state import TrainingState
    from pipeline.runtime.errors import DiskFullError
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    io = DCPCheckpointIO(TrainingState())
    io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 10}, sys.argv[1] + "/step-000000010")
    try:
        io.save_checkpoint({"state_dict": {"w": torch.ones(1 << 20)}, "global_step": 20},
                           sys.argv[1] + "/step-000000020")
    except DiskFullError as e:
        print(e.strerror)
        sys.exit(3)
''')


@pytest.fixture()
def small_disk(tmp_path):
    """A 1 MiB filesystem (tmpfs), where the machine lets the tests mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(small_disk):
    from pipeline.checkpoint.discovery import complete_checkpoints
    from pipeline.checkpoint.manifest import verify_checkpoint

    proc = subprocess.run([PYTHON, "-c", CHECKPOINT_FULL, str(small_disk), str(free_port())], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert str(small_disk) in line and "needs about 4.0 MiB" in line and "free" in line, line
    assert [p.name for p in small_disk.iterdir()] == ["step-000000010"]  # nothing of the refused write
    assert [p.name for p in complete_checkpoints(small_disk)] == ["step-000000010"]
    assert verify_checkpoint(small_disk / "step-000000010") == []


@pytest.mark.parametrize("args, message", [
    (["data=criteo_kaggle", "data.path={avazu}"],
     "Error (BadInputError): {avazu}:1: 1 column, expected 40 (data=criteo_kaggle, separated by '\\t'); it splits into 24 "
     "columns at ','"),
    # the same exit path as the case above, other error classes (their messages: test_checkpointing, test_config)
    pytest.param(["trainer.resume=/nonexistent/step-000000010"], "Error (FileNotFoundError): /nonexistent/"
                 "step-000000010 is not a checkpoint directory", marks=pytest.mark.slow),
    pytest.param(["model.embedding_dim=10"], "Error (ConfigError): model.embedding_dim=10: must be a positive multiple "
                 "of 4", marks=pytest.mark.slow),
])
def test_user_errors_print_one_line_and_exit_2(tmp_path, args, message):
    from tests.conftest import shared_file

    avazu = str(shared_file("avazu_sample/avazu_sample.csv"))
    args = [a.format(avazu=avazu) for a in args]
    proc, _ = _train([f"paths.cache_dir={tmp_path}/cache", *args], tmp_path / "run", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message.format(avazu=avazu) in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    full = subprocess.run([PYTHON, "-m", "pipeline.commands.train", f"paths.cache_dir={tmp_path}/cache", *args,
                           f"hydra.run.dir={tmp_path}/run2"], cwd=ROOT, env=subprocess_env(HYDRA_FULL_ERROR="1"),
                          capture_output=True, text=True, timeout=300)
    assert full.returncode != 0 and "Traceback" in full.stderr  # HYDRA_FULL_ERROR=1 shows everything


def test_a_log_smaller_than_one_batch_is_refused_before_training_instead_of_training_nothing(tmp_path):
    """5,000 rows (~85 % to train) at batch 8,192 train no batch: that once ran 0 steps, printed a test AUC, published a
    model and exited 0. Now: one line naming the rows, the batch and the key."""
    import numpy as np

    from pipeline.data.pass1 import assign_splits
    from pipeline.data.preprocess_config import SplitConfig

    train_rows = int((assign_splits(np.arange(5000), 5000, SplitConfig("random", 0.05, 0.1, 0)) == 0).sum())
    common = [f"paths.cache_dir={tmp_path}/cache", "data.synthetic.rows=5000", "trainer.enable_progress_bar=false",
              f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    proc, result = _train([*common, "trainer.batch_size=8192"], tmp_path / "run", check=False)
    assert proc.returncode == 2 and result is None, proc.stderr[-3000:]
    assert (f"Error (ConfigError): trainer.batch_size=8192: the training split holds {train_rows:,} rows, fewer than "
            f"one batch, so no training step would run; set trainer.batch_size to at most {train_rows:,}") in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "model").exists()


def test_unexpected_errors_keep_their_traceback(small_overrides, tmp_path):
    # a bug, not a user error: a callback that raises
    proc, _ = _train([*small_overrides, "trainer.max_steps=2",
                      "trainer.callbacks=[{_target_:tests.faults.RaiseAtStep,step:1}]"], tmp_path / "run", check=False)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: injected failure" in proc.stderr


def test_undelivered_logging_is_kept_locally_and_replays_to_the_server(tmp_path):
    """The server dies for good after the run starts: the queued calls land in the fallback store;
    once a server is back, pipeline.commands.sync puts every value into the original run."""
    from pipeline.tracking.logger import QueuedClient, TrackedMLflowLogger
    from pipeline.tracking.store import bound_http_requests

    bound_http_requests()
    server = MlflowServer(tmp_path / "srv").start()
    try:
        logger = TrackedMLflowLogger(experiment_name="outage", tracking_uri=server.uri)
        run_id = logger.start()
        assert isinstance(logger.experiment, QueuedClient)
        server.kill()
        t0 = time.perf_counter()
        for step in range(5):
            logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)  # returns at once: queued
        logger.log_hyperparams({"model": {"name": "deepfm"}})
        assert time.perf_counter() - t0 < 1.0
        lines = logger.close(timeout_s=2, folder=tmp_path / "out")
        assert len(lines) == 2 and "did not reach" in lines[0] and "ctr sync source=" in lines[1], lines
        local = f"sqlite:///{(tmp_path / 'out' / FALLBACK_DB).resolve()}"
        kept = MlflowClient(local).search_runs([e.experiment_id for e in MlflowClient(local).search_experiments()])
        assert len(kept) == 1 and kept[0].data.tags[ORIGINAL_RUN_TAG] == run_id
        server.start()
        sync = subprocess.run([PYTHON, "-m", "pipeline.commands.sync", f"source={local}"], cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=120)
        assert sync.returncode == 0 and f"{server.uri} run {run_id}: 5 metric values" in sync.stdout, sync.stderr
        client = MlflowClient(server.uri)
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
        assert history == [(s, 1.0 / (s + 1)) for s in range(5)]
        assert client.get_run(run_id).data.params["model/name"] == "deepfm"
        assert client.get_run(run_id).info.status == "FINISHED"
        from pipeline.commands.sync import sync  # the command's work, in this process (the command ran above)

        assert sync(local, server.uri) == []  # synced runs are not copied twice
        assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == history
    finally:
        server.kill()
