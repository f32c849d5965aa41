"""Continuing training on the next day's data: ``trainer.init_from`` plus a vocabulary that grows
(``data.preprocess.base_vocabulary``), checked on generated days of one click model whose user window
drifts (day d: users 60·d … 60·d + 199; the tags and the click model are shared)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.click_logs import DATASET_YAML, click_log, write_dataset
from tests.conftest import train_cli

ROWS = 8_000


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    folder = tmp_path_factory.mktemp("days")
    for d in (1, 2, 3):
        click_log(ROWS, seed=100 + d, first_user=60 * d)[0].to_csv(folder / f"day{d}.csv", index=False)
    conf = write_dataset(folder / "conf", DATASET_YAML).parent.parent
    args = ["--config-dir", str(conf), "data=mylog", f"paths.cache_dir={folder / 'cache'}",
            f"logger.tracking_uri=sqlite:///{folder / 'mlflow.db'}", "trainer.batch_size=512", "trainer.max_epochs=2",
            "model.mlp=[32]", "model.embedding_dim=8", "trainer.enable_progress_bar=false",
            "topology.sharding_types=[table_wise]"]
    return folder, args


def _day3_auc(model, folder) -> float:
    from pipeline.scoring.prediction import PredictArgs, run

    result = run(PredictArgs(checkpoint=str(model), input=str(folder / "day3.csv"),
                             output=str(model.parent / "d3.parquet")))
    return result.auc


@pytest.fixture(scope="module")
def day1(days):
    """Day 1's run (with checkpoints, for the optimizer state)."""
    folder, args = days
    _, first = train_cli([*args, f"data.path={folder / 'day1.csv'}", f"trainer.checkpoint.dir={folder / 'A1ck'}"],
                         folder / "A1")
    return first


def test_continued_model_beats_one_day_model_on_the_next_day_with_2_processes_from_1(days, day1):
    folder, args = days
    first, model_1 = day1, folder / "A1" / "model"
    # day 2 from day 1's model, on 2 processes (the 1-process model is resharded on load); its vocabulary is
    # the default base (data.preprocess.base_vocabulary=auto)
    proc, continued = train_cli([*args, f"data.path={folder / 'day2.csv'}", f"trainer.init_from={model_1}"],
                                folder / "A2",
                                launcher=["-m", "torch.distributed.run", "--nproc_per_node=2"])
    _, alone = train_cli([*args, f"data.path={folder / 'day2.csv'}"], folder / "B2")
    a, b = _day3_auc(folder / "A2" / "model", folder), _day3_auc(folder / "B2" / "model", folder)
    assert a > b + 0.02, f"day-3 AUC: day 1 then day 2 {a:.4f}, day 2 only {b:.4f}"
    # model.stack_tables=auto stacks on one CPU rank; on 2 table-wise ranks it keeps the source's layout
    layouts = [json.loads((m / "model.json").read_text())["model"]["stack_tables"]
               for m in (model_1, folder / "A2" / "model", folder / "B2" / "model")]
    assert layouts == [True, True, True], layouts
    # ids known on day 1 keep their rows; values new on day 2 are appended
    for table in ("user_id", "tags", "hour"):
        old = pq.read_table(model_1 / "vocab" / f"{table}.parquet").column("key").to_numpy()
        new = pq.read_table(folder / "A2" / "model" / "vocab" / f"{table}.parquet").column("key").to_numpy()
        np.testing.assert_array_equal(new[:len(old)], old, err_msg=table)
    users_1 = pq.read_table(model_1 / "vocab" / "user_id.parquet").num_rows
    users_2 = pq.read_table(folder / "A2" / "model" / "vocab" / "user_id.parquet").num_rows
    assert users_2 > users_1 + 30, (users_1, users_2)  # day 2's new users (260 … 319) got rows
    # lineage: the continued run names its parent
    import mlflow

    tags = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").get_run(continued.mlflow_run_id).data.tags
    assert tags["ctr.parent_run_id"] == first.mlflow_run_id and tags["ctr.init_from"] == str(model_1.resolve())


def test_init_from_optimizer_carries_the_state_rows_mapped(days, day1):
    """One step on day 2 from day 1's checkpoint with and without the optimizer state: both runs take the same
    first gradients (same weights, data and seed), so the carried state is exactly the difference — row-wise
    Adagrad's accumulator adds (mapped rows: carried − fresh = day 1's row; new rows: equal), Adam's moments
    decay once (carried − fresh = β·day 1's) and its step count continues."""
    from modules.embedding.sparse_arch import FeatureSpec
    from pipeline.checkpoint.discovery import newest_intact_checkpoint
    from pipeline.checkpoint.full_state import full_model_state
    from pipeline.checkpoint.run_description import checkpoint_run
    from pipeline.training.init_from import row_sources

    folder, args = days
    source = newest_intact_checkpoint(folder / "A1ck")
    after = {}
    for parts in ("all", "none"):  # the checkpoint folder means its newest checkpoint, whose vocabulary is kept
        train_cli([*args, f"data.path={folder / 'day2.csv'}", f"trainer.init_from={folder / 'A1ck'}",
                   f"trainer.init_from_optimizer={parts}",
                   "trainer.max_steps=1", "trainer.checkpoint.every_n_steps=1", "logger.log_model=false",
                   f"trainer.checkpoint.dir={folder / ('opt_' + parts)}"], folder / f"opt_{parts}_run")
        after[parts] = newest_intact_checkpoint(folder / f"opt_{parts}")
    old_spec = FeatureSpec.from_store_meta(checkpoint_run(source).store.meta)
    new_spec = FeatureSpec.from_store_meta(checkpoint_run(after["all"]).store.meta)
    prefix = "fused_optimizer/"
    old, carried, fresh = (full_model_state(p, prefix) for p in (source, after["all"], after["none"]))
    assert old and set(carried) == set(old) == set(fresh)
    new_rows = 0
    for key, start in old.items():
        rows = row_sources(key.split("/")[0], old_spec, new_spec, carried[key].shape[0])
        kept = rows >= 0
        assert kept.sum() == len(start), key
        new_rows += int((~kept).sum())
        np.testing.assert_allclose(carried[key][kept] - fresh[key][kept], start[rows[kept]], rtol=1e-4, atol=1e-7,
                                   err_msg=key)
        np.testing.assert_allclose(carried[key][~kept], fresh[key][~kept], rtol=1e-5, atol=1e-9, err_msg=key)
    assert new_rows > 30  # day 2's new users and tags
    prefix = "rank0/optimizer_states/0/state/"
    old, carried, fresh = (full_model_state(p, prefix) for p in (source, after["all"], after["none"]))
    assert old and set(carried) == set(old)
    for key, start in old.items():
        if key.endswith("/step"):
            assert float(carried[key]) == float(start) + 1 and float(fresh[key]) == 1, key
        else:
            beta = 0.9 if key.endswith("/exp_avg") else 0.999
            np.testing.assert_allclose(carried[key] - fresh[key], beta * start, rtol=1e-4, atol=1e-8, err_msg=key)


def test_the_init_from_source_is_checked_once_and_the_config_parse_hashes_nothing(days, day1, monkeypatch):
    """Every file of a checkpoint is hashed against its manifest when the run resolves ``trainer.init_from``
    (:func:`init_source`), once; parsing the config (which reads the vocabulary's place from the
    checkpoint's description), the lineage tags and reading the weights hash nothing more."""
    from pipeline.checkpoint import manifest
    from pipeline.checkpoint.discovery import newest_intact_checkpoint
    from pipeline.config import compose_run_config
    from pipeline.training.init_from import init_source, lineage_tags, source_weights

    folder, _ = days
    newest = newest_intact_checkpoint(folder / "A1ck")
    hashed: list[Path] = []
    real = manifest.sha256
    monkeypatch.setattr(manifest, "sha256", lambda path: hashed.append(Path(path)) or real(path))
    run = compose_run_config([f"trainer.init_from={folder / 'A1ck'}"])
    assert hashed == [] and run.data.preprocess.base_vocabulary.startswith(str(folder / "cache"))
    source = init_source(str(folder / "A1ck"))
    files = json.loads((newest / manifest.MANIFEST).read_text())["files"]
    assert source.path == newest and sorted(map(str, hashed)) == sorted(str(newest / f) for f in files)
    checked = len(hashed)
    assert lineage_tags(source)["ctr.init_from"] == str(newest.resolve())
    weights, _ = source_weights(source, folder / "init_tables")
    assert weights and len(hashed) == checked  # nothing hashed again


def test_init_from_optimizer_needs_a_checkpoint(days, day1):
    folder, args = days
    proc, _ = train_cli([*args, f"data.path={folder / 'day2.csv'}", f"trainer.init_from={folder / 'A1' / 'model'}",
                         "trainer.init_from_optimizer=dense", "trainer.max_steps=1"], folder / "opt_bundle", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Error (ConfigError): trainer.init_from_optimizer=dense: " in proc.stderr, proc.stderr[-2000:]
    assert "is a model folder, which holds weights only" in proc.stderr and "preprocess pass" not in proc.stderr


def test_init_from_copies_known_rows_and_keeps_new_rows_fresh():
    """row_sources: a grown table keeps its old rows in place; a first-order table moves each table's segment."""
    from modules.embedding.sparse_arch import FeatureSpec
    from pipeline.training.init_from import row_sources

    old = FeatureSpec((), ("a", "b"), {"a": 4, "b": 3})
    new = FeatureSpec((), ("a", "b"), {"a": 6, "b": 5})
    assert row_sources("sparse_arch.ebc.embedding_bags.emb_a.weight", old, new, 6).tolist() == [0, 1, 2, 3, -1, -1]
    # wide rows: a at 0..3 → 0..3 (+2 new), b at 4..6 → 6..8 (+2 new)
    assert row_sources("sparse_arch.ebc.embedding_bags.wide.weight", old, new, 11).tolist() == \
        [0, 1, 2, 3, -1, -1, 4, 5, 6, -1, -1]
    # vocabulary position 0 of b (id 2, an old row) now names a new value (eviction): its rows start afresh
    reused = {"b": np.array([0])}
    assert row_sources("sparse_arch.ebc.embedding_bags.emb_b.weight", old, new, 5, reused).tolist() == \
        [0, 1, -1, -1, -1]
    assert row_sources("sparse_arch.ebc.embedding_bags.wide.weight", old, new, 11, reused).tolist() == \
        [0, 1, 2, 3, -1, -1, 4, 5, -1, -1, -1]
    # model.stack_tables: the emb tables stacked in the first-order table's layout, so the same rows move
    assert row_sources("sparse_arch.ebc.embedding_bags.stacked.weight", old, new, 11, reused).tolist() == \
        [0, 1, 2, 3, -1, -1, 4, 5, -1, -1, -1]


def test_daily_driver_logs_a_run_per_day_and_the_next_day_auc(days, tmp_path):
    """``ctr daily`` over three days (with eviction: rows of reused ids start afresh; optimizer state
    carried): one MLflow run per day chained by lineage tags, each day scored by the previous day's model
    before training (logged to that model's run), the plot and table written."""
    import mlflow

    folder, args = days
    files = ",".join(str(folder / f"day{d}.csv") for d in (1, 2, 3))
    uri = f"sqlite:///{tmp_path / 'daily.db'}"
    proc, _ = train_cli([*args, f"data.path=[{files}]", "trainer.max_epochs=1",
                         "data.preprocess.evict_after=1", "trainer.init_from_optimizer=all",
                         f"logger.tracking_uri={uri}"], tmp_path / "daily", command="daily")
    table = (tmp_path / "daily" / "next_day_auc.md").read_text().splitlines()
    assert len(table) == 2 + 3 and (tmp_path / "daily" / "next_day_auc.png").stat().st_size > 0
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time ASC"])
    assert [r.data.tags["mlflow.runName"] for r in runs] == ["day 0", "day 1", "day 2"]
    assert runs[1].data.tags["ctr.parent_run_id"] == runs[0].info.run_id
    assert runs[2].data.tags["ctr.parent_run_id"] == runs[1].info.run_id
    # carrying the optimizer state, each day starts from the previous day's newest checkpoint
    assert runs[2].data.tags["ctr.init_from"].startswith(str((tmp_path / "daily" / "day_1" / "checkpoints").resolve()))
    scored = [r.data.metrics.get("next_day/auc") for r in runs]
    assert scored[2] is None and all(0.3 < a < 1 for a in scored[:2]), scored
    # the next-day AUC logged for day 0's model is that model's AUC on all of day 1's rows, as printed
    assert f"AUC {scored[0]:.6f}" in proc.stdout
    assert "next_day_auc.png" in [a.path for a in client.list_artifacts(runs[2].info.run_id)]


def test_eviction_keeps_tables_bounded_over_drifting_days(tmp_path):
    """Four days whose user window moves by 60 of 200 per day: without eviction the user table keeps growing
    (every user ever seen); with evict_after=1 it holds the current day's users, ids of the users still
    present unchanged, evicted positions reused by new users."""
    from pipeline.data.preprocess import preprocess
    from tests.test_own_data import declaration

    sizes = {None: [], 1: []}
    for evict in sizes:
        base = None
        for d in range(4):
            frame = click_log(3000, seed=10 + d, first_user=60 * d)[0]
            frame.to_csv(tmp_path / f"d{d}.csv", index=False)
            data = declaration(preprocess={"min_count": 1, "base_vocabulary": base, "evict_after": evict,
                                           "split": {"method": "random", "valid": 0.0, "test": 0.0}})
            store = preprocess([tmp_path / f"d{d}.csv"], data, tmp_path / f"s{evict}_{d}")
            keys = pq.read_table(store.root / "vocab" / "user_id.parquet").column("key").to_numpy()
            if base is not None:
                before = pq.read_table(base / "vocab" / "user_id.parquet").column("key").to_numpy()
                kept = keys[:len(before)] == before
                assert kept[np.isin(before, keys)].all()  # a user still there kept its id
            sizes[evict].append(store.table_sizes["user_id"] - 2)
            assert store.meta["vocabulary_day"] == d
            base = store.root
    assert sizes[None] == [200, 260, 320, 380], sizes
    assert max(sizes[1]) <= 260 and sizes[1][-1] <= sizes[1][1], sizes  # bounded: live users + free slots
