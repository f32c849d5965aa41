"""The ``ssd`` tier on CPU (modules/embedding/ssd_tier/files.py): tables in memory-mapped files train, checkpoint,
resume, export and score exactly as in host memory, and are never loaded whole into memory."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from modules.sharding.placement import PlacementError, TableInfo, place_tables
from modules.sharding.topology import GB, SsdSpec, TopologySpec
from tests.conftest import PYTHON, ROOT, subprocess_env, train_cli

ALL_ON_SSD = "topology.ddr_cap_gb=1e-12"  # a host budget below one row: every table goes to the ssd tier
SMALL_CACHE = "topology.ssd.cache_mb=40"  # the row cache, set outright: the floors (4 × ids of a 4,096-row batch) and a little more


def _cpu(ddr_gb: float, ssd_path: str | None, cache_mb: float | None = None, **overrides) -> TopologySpec:
    return TopologySpec(name="cpu", compute_device="cpu", ddr_cap_gb=ddr_gb, ssd=SsdSpec(path=ssd_path, cache_mb=cache_mb),
                        table_overrides=overrides)


def test_cpu_placement_sends_the_largest_tables_to_ssd_when_host_memory_cannot_hold_them(tmp_path):
    # bytes with row-wise Adagrad: rows · 4 · (16 + 1)
    tables = [TableInfo("a", 1_000, 16), TableInfo("b", 10_000, 16), TableInfo("c", 100, 16)]
    budget = 226_050  # holds a (68,000 B) and c (6,800 B), not b (680,000 B); 150,000 B left for b's row cache
    # once its written bits (1,250 B) are taken
    slot = 68 + 17 + (68 + 8) / 8 + 16  # a slot: the row with its state, bookkeeping, memtable share, run filters
    ddr = budget / 0.75 / GB
    placed = place_tables(tables, _cpu(ddr, str(tmp_path)), "rowwise_adagrad")
    assert {n: p.tier for n, p in placed.items()} == {"a": "host", "b": "ssd", "c": "host"}
    assert placed["b"].cache_rows == 150_000 // slot and placed["a"].cache_rows is None
    # what the process holds itself is taken from the budget: the cache shrinks, then cannot be
    assert place_tables(tables, _cpu(ddr, str(tmp_path)), "rowwise_adagrad", process_bytes=4_000)["b"].cache_rows \
        == 146_000 // slot
    # the every-row L2's last step of each row (4 B × 11,100 rows) is host memory wherever the row lives: a budget
    # larger by exactly that gives b the same cache; the same budget no longer gives it the least one
    with_state = (budget + 4 * 11_100) / 0.75 / GB
    assert place_tables(tables, _cpu(with_state, str(tmp_path)), "rowwise_adagrad", row_state_bytes=4)["b"].cache_rows \
        == 150_000 // slot
    with pytest.raises(PlacementError, match=r"tables get no row cache"):
        place_tables(tables, _cpu(ddr, str(tmp_path)), "rowwise_adagrad", row_state_bytes=4)
    with pytest.raises(PlacementError, match=r"tables get no row cache: they need 0.2 MB at least.*own 0 MB per rank. Raise topology.ddr_cap_gb"):
        place_tables(tables, _cpu(ddr, str(tmp_path)), "rowwise_adagrad", process_bytes=50_000)  # < 1,024 slots
    assert place_tables(tables, _cpu(ddr, str(tmp_path), cache_mb=0.5), "rowwise_adagrad",
                        process_bytes=50_000)["b"].cache_rows == 2**19 // slot  # set outright
    forced = place_tables(tables, _cpu(1.0, str(tmp_path), c={"tier": "ssd"}), "sgd")
    assert {n: p.tier for n, p in forced.items()} == {"a": "host", "b": "host", "c": "ssd"}
    assert forced["c"].cache_rows == 100  # the whole table: the budget holds it
    assert {p.kernel for p in forced.values()} == {"fused"}  # the same FBGEMM CPU kernel on both tiers
    with pytest.raises(PlacementError, match="host needs 0.0 GB of 0.0 GB .tables forced there"):
        place_tables(tables, _cpu(ddr, str(tmp_path), b={"tier": "host"}), "sgd")  # a moves, b cannot
    assert {p.tier for p in place_tables(tables, _cpu(0.0, None), "rowwise_adagrad").values()} == {"host"}
    with pytest.raises(PlacementError, match=r"tables \['b'\] need tier ssd .*set topology.ssd.path"):
        place_tables(tables, _cpu(ddr, None), "rowwise_adagrad")
    with pytest.raises(PlacementError, match="optim.embedding.name=adam keeps every table in memory"):
        place_tables(tables, _cpu(ddr, str(tmp_path)), "adam", fusable=False)
    with pytest.raises(PlacementError, match="a CPU topology has the tiers host and ssd"):
        place_tables(tables, _cpu(ddr, str(tmp_path), a={"tier": "uvm_cache"}), "sgd")


def _tables_of(model_folder: Path) -> dict[str, torch.Tensor]:
    from pipeline.model_folder.weights import read_weights

    return read_weights(model_folder)


def test_ssd_tier_trains_with_cowclip_and_l2_on_every_row_exactly_like_host_memory(small_overrides, tmp_path):
    """``scaling=cowclip``: CowClip's hooks and the lazy every-row L2 (flushed in row blocks) act on the
    file-backed tables as on tables in memory; ``trainer.init_from`` fills file-backed tables row for row."""
    # a table per feature in both runs (auto would stack the host-memory ones): the tier is what differs
    base = [*small_overrides, "trainer.max_epochs=1", "logger.log_model=true", "scaling=cowclip",
            f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "model.stack_tables=false"]
    _, host = train_cli(base, tmp_path / "host")
    # checkpoints every 7 steps: each writes every dirty row back between a look-ahead and its step
    at_end = (f"trainer.callbacks=[{{_target_:tests.faults.SsdFilesAtEnd,folder:{tmp_path}/ssd,"
              f"record:{tmp_path}/files}}]")
    proc, ssd = train_cli([*base, f"topology.ssd.path={tmp_path}/ssd", ALL_ON_SSD, SMALL_CACHE, "topology.ssd.look_ahead=true",
                           f"trainer.checkpoint.dir={tmp_path}/ckpt", "trainer.checkpoint.every_n_steps=7", at_end],
                          tmp_path / "on_ssd")
    # topology.ssd.look_ahead: the caches brought each next batch's rows in while the step computed, and they were used
    ahead = re.search(r"brought in ahead for (\d+) lookups \((\d+) not used\)", proc.stdout + proc.stderr)
    assert ahead and int(ahead[1]) > 0, (proc.stdout + proc.stderr)[-3000:]
    print("look-ahead taken / not used:", ahead[1], ahead[2])
    plan = [line for line in (tmp_path / "on_ssd" / "sharding_plan.txt").read_text().splitlines()
            if line.startswith("| emb_") or line.startswith("| wide")]
    assert plan and all("| ssd | fused |" in line for line in plan), plan
    # the run deleted its files at its end (only the lock file stays)
    assert [p.name for p in (tmp_path / "ssd" / "rank0").iterdir()] == [".lock"]
    # same kernels, same seed: the same numbers to the last bit
    assert (ssd.test_auc, ssd.test_logloss) == (host.test_auc, host.test_logloss)
    a, b = _tables_of(tmp_path / "host" / "model"), _tables_of(tmp_path / "on_ssd" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the files held the trained tables' rows, byte for byte, at the end of training (copied then by the callback)
    layout = json.loads((tmp_path / "files" / "tables.json").read_text())
    trained = {k.split(".")[-2]: v for k, v in b.items()
               if k.endswith(".weight") and v.dim() == 2 and ("embedding_bags" in k or "embeddings" in k)}
    assert sorted(name for tables in layout.values() for name, _ in tables) == sorted(trained)
    for file, tables in layout.items():
        on_disk = torch.from_numpy(np.fromfile(tmp_path / "files" / file, dtype=np.float32))
        assert len(on_disk) == sum(trained[name].numel() for name, _ in tables)
        for name, start in tables:
            w = trained[name]
            assert torch.equal(on_disk[start:start + w.numel()].view_as(w), w), name
    # init_from a host-memory model into file-backed tables; learning rates 0: the tables stay the source's
    train_cli([*small_overrides, "trainer.max_steps=2", "logger.log_model=true", f"trainer.init_from={tmp_path}/host/model",
               "optim.embedding.lr=0", f"topology.ssd.path={tmp_path}/ssd2", ALL_ON_SSD, SMALL_CACHE,
               f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"], tmp_path / "init")
    c = _tables_of(tmp_path / "init" / "model")
    tables = [k for k in a if a[k].dim() == 2 and ("embedding_bags" in k or "embeddings" in k)]
    assert tables and all(torch.equal(a[k], c[k]) for k in tables)


# ---- a model of a few GB: memory ----

BIG_ROWS = 40_000_000  # one hashed table: 40M × 16 × 4 B = 2.56 GB, plus the first-order table 40M × 4 × 4 B


def _limited(limit_gib: float, folder: Path) -> Path | None:
    """A child memory cgroup (v1) of this process's one with ``limit_gib`` (page cache included), or None
    where none can be made (no cgroup v1 memory controller, not root)."""
    try:
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.split(":")[1] == "memory")
        group = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / f"ctr-test-{folder.name}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(int(limit_gib * 2**30)))
        return group
    except (OSError, StopIteration, IndexError):
        return None


def _peak_anon_mib(cmd: list[str], cwd: Path, group: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` (in the memory cgroup ``group``); its peak RssAnon (anonymous resident memory: file-backed
    pages excluded), sampled every 20 ms."""
    if group is not None:
        cmd = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
    proc = subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))
                peak[0] = max(peak[0], anon)
            except (OSError, StopIteration):
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=900)
    watcher.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak[0] / 1024


def _one_hashed_table(folder: Path, buckets: int, n: int = 20_000, distinct: int | None = None) -> list[str]:
    """Overrides for a log of ``n`` rows (``folder/log.csv``) with one categorical feature hashed to ``buckets``
    rows (a dataset declared in ``folder/conf``; ``distinct`` users, default one per row), DeepFM with a small
    MLP, batch 4,096, one epoch."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, 10**9, n) if distinct is None else rng.integers(0, 10**9, distinct)[rng.integers(0, distinct, n)]
    frame = pd.DataFrame({"clicked": (users % 7 == 0).astype(int), "user": users, "price": rng.random(n)})
    folder.mkdir(parents=True, exist_ok=True)
    frame.to_csv(folder / "log.csv", index=False)
    (folder / "conf" / "data").mkdir(parents=True)
    (folder / "conf" / "data" / "big.yaml").write_text(
        f"name: big\nformat: csv\npath: ???\nheader: true\nlabel: clicked\nfeatures:\n"
        f"  - {{name: user, type: categorical}}\n  - {{name: price, type: numeric, transform: log1p}}\n"
        f"preprocess: {{categorical: hash, hash_buckets: {buckets}}}\n")
    return ["--config-dir", str(folder / "conf"), "data=big", f"data.path={folder / 'log.csv'}",
            f"paths.cache_dir={folder / 'cache'}", f"logger.tracking_uri=sqlite:///{folder}/mlflow.db",
            "model.mlp=[16]", "trainer.batch_size=4096", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
            "logger.log_model=false"]


CI_ROWS = 40_000_000  # 3.5 GB of tables with their state: over 4 times what the run may hold besides them


def test_peak_anonymous_memory_is_the_row_cache_plus_what_a_small_table_run_holds(tmp_path):
    """A hashed table of 3.5 GB (with its row-wise state and first-order table) on the ssd tier behind a 1.5 MB
    row cache trains a whole epoch — 16 steps over 8,000 distinct ids, so rows are evicted, written to the
    sorted runs and read back — and a checkpoint (every row of the tables written out), in a
    process whose peak anonymous memory (RssAnon, sampled every 20 ms throughout) is at most that of the same
    run with a table of 1,000 rows in memory plus the cache and 100 MB: the table never reaches anonymous
    memory (its files are sparse, evicted rows go out one at a time, the checkpoint streams them)."""
    users = ["trainer.batch_size=1024", "trainer.eval_batch_size=1024", "topology.ssd.cache_mb=1.5",
             "trainer.max_epochs=1"]
    small = _one_hashed_table(tmp_path / "small", 1_000, n=16_000, distinct=8_000) + users
    big = _one_hashed_table(tmp_path / "big", CI_ROWS, n=16_000, distinct=8_000) + users + [
        f"topology.ssd.path={tmp_path / 'ssd'}", ALL_ON_SSD]
    train_cli(big, tmp_path / "prep", command="plan")  # the store, built outside the measured runs
    peaks = {}
    checkpoint = [f"trainer.checkpoint.dir={tmp_path / 'ckpt'}"]  # at the end of the epoch
    for name, args in (("small", small), ("big", [*big, *checkpoint])):
        proc, peaks[name] = _peak_anon_mib([PYTHON, "-m", "pipeline.commands.train", *args,
                                            f"hydra.run.dir={tmp_path / name}"], ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    caches = re.search(r"rows read ([\d,]+) .*, drawn [\d,]+, written ([\d,]+)", proc.stdout)
    read, written = (int(caches[i].replace(",", "")) for i in (1, 2))
    assert read > 0 and written > 1000, proc.stdout[-2000:]  # evicted rows went out and came back
    assert list((tmp_path / "ckpt").glob("step-*"))  # the checkpoint was written inside the measured run
    table_mib = CI_ROWS * (4 * (16 + 1) + 4 * (4 + 1)) / 2**20
    bound = peaks["small"] + 1.5 + 100
    print(f"tables {table_mib:,.0f} MiB; peak anonymous MiB {peaks}; bound {bound:,.0f}; cache rows read {read:,}, "
          f"written {written:,}")
    assert peaks["big"] <= bound, peaks
    assert table_mib > 4 * bound, (table_mib, bound)


@pytest.mark.slow
def test_a_table_of_a_few_gb_on_the_ssd_tier_is_never_loaded_into_memory(tmp_path):
    """Train (with a checkpoint), resume, export and predict a model whose tables take 3.5 GB with
    their optimizer state, each process limited to 2 GiB (a memory cgroup, page cache included, where
    the machine allows one): all succeed, and each peak anonymous memory stays far below the tables."""
    n = 20_000
    args = _one_hashed_table(tmp_path, BIG_ROWS, n) + [
        f"topology.ssd.path={tmp_path / 'ssd'}", ALL_ON_SSD, SMALL_CACHE, f"trainer.checkpoint.dir={tmp_path / 'ckpt'}"]
    table_gb = BIG_ROWS * (4 * (16 + 1) + 4 * (4 + 1)) / 1e9  # weights and row-wise state of both tables
    train_cli([*args, "trainer.max_steps=1"], tmp_path / "prep")  # builds the store (hashing counts 40M buckets)
    peaks = {}
    group = _limited(2.0, tmp_path)
    try:
        for name, extra in (("train", ["trainer.max_steps=3"]),
                            ("resume", ["trainer.max_steps=4", "trainer.resume=auto"])):
            proc, peaks[name] = _peak_anon_mib([PYTHON, "-m", "pipeline.commands.train", *args, *extra,
                                                f"hydra.run.dir={tmp_path / name}"], ROOT, group)
            assert proc.returncode == 0, proc.stderr[-3000:]
        proc, peaks["export"] = _peak_anon_mib([PYTHON, "-m", "pipeline.commands.export", f"checkpoint={tmp_path / 'ckpt'}",
                                                f"out={tmp_path / 'model'}"], ROOT, group)
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc, peaks["predict"] = _peak_anon_mib([PYTHON, "-m", "pipeline.commands.predict", f"checkpoint={tmp_path / 'model'}",
                                                 f"input={tmp_path / 'log.csv'}", f"output={tmp_path / 'p.parquet'}"],
                                                ROOT, group)
        assert proc.returncode == 0 and f"Wrote {n} predictions" in proc.stdout, proc.stderr[-3000:]
    finally:
        if group is not None:
            group.rmdir()
    print(f"tables {table_gb:.2f} GB; limit {'2 GiB' if group else 'none'}; peak anonymous MiB: {peaks}")
    assert all(mib < 0.35 * table_gb * 1e3 for mib in peaks.values()), (table_gb, peaks)


def test_a_second_run_on_the_same_ssd_path_is_refused_naming_the_first(small_overrides, tmp_path):
    """Two runs on one topology.ssd.path: the second would truncate the first one's mapped table files. A process
    holding rank 0's folder (as a running job does) makes a training run there stop before it writes anything,
    with the holder named; once the holder is gone (killed: the kernel drops its lock) the folder can be taken."""
    from modules.embedding.ssd_tier.path_lock import SsdPathInUseError, lock_rank_folder

    folder = tmp_path / "ssd" / "rank0"
    holder = subprocess.Popen(
        [PYTHON, "-c", "import sys, time\nfrom modules.embedding.ssd_tier.path_lock import lock_rank_folder\n"
                       "lock_rank_folder(sys.argv[1]); print('locked', flush=True); time.sleep(600)", str(folder)],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (folder / "emb.weights.f32").write_bytes(b"\x01" * 64)  # a file of the running job
        proc, _ = train_cli([*small_overrides, f"topology.ssd.path={tmp_path / 'ssd'}", ALL_ON_SSD, SMALL_CACHE,
                             "trainer.max_epochs=1", f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"],
                            tmp_path / "run", check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert re.search(rf"Error \(SsdPathInUseError\): topology.ssd.path: {folder} is in use by pid {holder.pid} on",
                         proc.stderr), proc.stderr[-3000:]
        assert (folder / "emb.weights.f32").read_bytes() == b"\x01" * 64  # untouched
        with pytest.raises(SsdPathInUseError, match=f"pid {holder.pid}"):
            lock_rank_folder(folder)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert lock_rank_folder(folder) == folder.resolve()
    assert [p.name for p in folder.iterdir()] == [".lock"]  # the dead holder's files: stale, deleted by the lock
