"""Replay runs kept in a local fallback store to a tracking server:
``ctr sync source=sqlite:///<output>/mlflow.db target=http://host:5000`` (``python -m pipeline.commands.sync ...``).

Each run of the local store that carries the tag ``ctr.original_run_id`` (written by
:mod:`pipeline.tracking.logger` when logging calls could not reach the server in time) is copied into that
original run on the target — or into a new run of the same experiment if the target does not have
it: parameters, every metric's full history (values, steps, timestamps), tags, artifacts and the
final status. A synced local run is tagged ``ctr.synced_to`` and skipped the next time. Then the
target's RUNNING runs whose process is gone from this machine are marked FAILED at once, and those whose last beat
looks overdue are watched for 5 of their beats and marked if they stay silent (:mod:`pipeline.tracking.heartbeat`).
``ctr sync target=sqlite:///mlflow.db`` does only that.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import hydra
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from pipeline.tracking.heartbeat import mark_stale_runs
from pipeline.tracking.logger import ORIGINAL_RUN_TAG, ORIGINAL_URI_TAG
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path

SYNCED_TAG = "ctr.synced_to"
BATCH = 1000  # MLflow's log_batch limit on metrics per call


def _target_run(target: MlflowClient, run_id: str, experiment: str) -> str:
    try:
        return target.get_run(run_id).info.run_id
    except MlflowException:
        found = target.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else target.create_experiment(experiment)
        return target.create_run(exp_id, tags={ORIGINAL_RUN_TAG: run_id}).info.run_id


def sync(source_uri: str, target_uri: str) -> list[tuple[str, str, int]]:
    """Copy every unsynced fallback run; returns (local run, target run, metric values copied)."""
    source, target = MlflowClient(source_uri), MlflowClient(target_uri)
    done = []
    for exp in source.search_experiments():
        for run in source.search_runs([exp.experiment_id], filter_string=f"tags.`{ORIGINAL_RUN_TAG}` != ''"):
            if SYNCED_TAG in run.data.tags:
                continue
            dest = _target_run(target, run.data.tags[ORIGINAL_RUN_TAG], exp.name)
            params = [Param(k, v) for k, v in run.data.params.items()]
            tags = [RunTag(k, v) for k, v in run.data.tags.items() if not k.startswith(("mlflow.", "ctr."))]
            target.log_batch(dest, params=params, tags=tags)
            metrics = [Metric(m.key, m.value, m.timestamp, m.step) for key in run.data.metrics
                       for m in source.get_metric_history(run.info.run_id, key)]
            for i in range(0, len(metrics), BATCH):
                target.log_batch(dest, metrics=metrics[i:i + BATCH])
            with tempfile.TemporaryDirectory() as tmp:
                if source.list_artifacts(run.info.run_id):
                    target.log_artifacts(dest, source.download_artifacts(run.info.run_id, "", tmp))
            if run.info.end_time:
                target.set_terminated(dest, run.info.status)
            source.set_tag(run.info.run_id, SYNCED_TAG, f"{target_uri} {dest}")
            done.append((run.info.run_id, dest, len(metrics)))
    return done


@dataclass
class SyncArgs:
    """``conf/sync.yaml``."""

    source: Optional[str] = None  # None: only look for dead runs in target
    target: Optional[str] = None


@hydra.main(version_base="1.3", config_path=config_path(), config_name="sync")
def main(cfg: DictConfig) -> None:
    from pipeline.commands.args import command_args

    args = command_args(cfg, SyncArgs)
    target = args.target
    if args.source is None and target is None:
        sys.exit("ctr sync: give source=<fallback store> (replayed to its server) and/or target=<store> (its runs "
                 "whose process died are marked FAILED)")
    if target is None:
        uris = {r.data.tags.get(ORIGINAL_URI_TAG) for e in MlflowClient(args.source).search_experiments()
                for r in MlflowClient(args.source).search_runs([e.experiment_id])} - {None}
        if len(uris) != 1:
            sys.exit(f"target=<tracking server> is needed: the store's runs come from "
                     f"{sorted(uris) or 'no known server'}")
        target = uris.pop()
    if args.source is not None:
        for local, dest, n in sync(args.source, target):
            print(f"run {local} -> {target} run {dest}: {n} metric values")
    mark_stale_runs(MlflowClient(target), overdue_only=True, say=print)


def cli() -> None:
    """``ctr sync`` / ``python -m pipeline.commands.sync``."""
    check_overrides(config_path(), "sync")
    main()


if __name__ == "__main__":
    cli()
