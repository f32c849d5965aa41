"""Fault injection (and what a test must see inside a run) as Lightning callbacks a test adds to a CLI run:

    python -m pipeline.commands.train ... 'trainer.callbacks=[{_target_: tests.faults.KillRank, rank: 0, step: 33}]'
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class KillRank(Callback):
    """Global rank ``rank`` SIGKILLs itself after training step ``step`` — in a run that did not resume
    from a checkpoint (so a restarted torchrun attempt, which resumes, lives). With ``record`` (a JSON file's
    path), it first writes there the step and the newest complete checkpoint in ``checkpoint_dir`` with its
    MLflow run: what a resume must continue, read before any restart can write."""

    def __init__(self, rank: int, step: int, record: str | None = None, checkpoint_dir: str | None = None) -> None:
        self.rank, self.step, self.record, self.checkpoint_dir = rank, step, record, checkpoint_dir

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and trainer.ckpt_path is None:
            if self.record:
                from pipeline.checkpoint.discovery import complete_checkpoints, read_rank0_state

                last = complete_checkpoints(self.checkpoint_dir)[-1]
                Path(self.record).write_text(json.dumps({
                    "step": trainer.global_step, "checkpoint": last.name,
                    "mlflow_run_id": read_rank0_state(last)["pipeline"]["mlflow_run_id"]}))
            os.kill(os.getpid(), signal.SIGKILL)


class HoldAtStep(Callback):
    """Global rank ``rank`` writes ``held`` after training step ``step``, then waits until the file ``release`` exists
    (at most ``limit_s``): a test acts on the job — cuts a link, loses a node — at a known step, however fast the
    machine trains."""

    def __init__(self, rank: int, step: int, held: str, release: str, limit_s: float = 300.0) -> None:
        self.rank, self.step, self.held, self.release, self.limit_s = rank, step, Path(held), Path(release), limit_s

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.held.write_text(str(self.step))
            deadline = time.monotonic() + self.limit_s
            while not self.release.exists() and time.monotonic() < deadline:
                time.sleep(0.1)


class TableCopies(Callback):
    """Each rank's table shards (its kernels' weights, by shard) saved to ``<folder>/{start,end}-rank<r>.pt`` when
    training starts and when fitting ends (after the last merge): what a test compares across copies of the tables."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        from modules.embedding.sharded_kernels import kernels

        shards = {}
        for _, _, kernel in kernels(pl_module.model):
            for config, weight in zip(kernel.config.embedding_tables, kernel.split_embedding_weights()):
                offsets = config.local_metadata.shard_offsets if config.local_metadata else [0, 0]
                shards[f"{config.name}@{offsets[0]},{offsets[1]}"] = weight.detach().cpu().clone()
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(shards, self.folder / f"{when}-rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "start")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "end")


class SignalDuringStep(Callback):
    """Global rank ``rank`` sends itself ``signum`` (default SIGTERM) as training step ``step`` starts (as a
    scheduler's signal would arrive mid-step), in a run that did not resume from a checkpoint."""

    def __init__(self, rank: int, step: int, signum: int = signal.SIGTERM) -> None:
        self.rank, self.step, self.signum = rank, step, signum

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank and trainer.ckpt_path is None:
            os.kill(os.getpid(), self.signum)


class NaNLabelsAtStep(Callback):
    """The batch of training step ``step`` gets NaN labels: its loss is NaN, the forward pass is not
    touched (no NaN reaches batch-norm statistics)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step:
            batch.labels.fill_(torch.nan)


class RaiseAtStep(Callback):
    """A bug stand-in: raises ``RuntimeError`` after training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("injected failure")


class SsdFilesAtEnd(Callback):
    """When training ends (the run deletes its ``ssd`` files at exit), copy rank 0's table weight files from
    ``folder`` (its ``rank0``) into ``record`` with ``tables.json``: per file, its TBE's tables and their
    offsets in it (every row written there first)."""

    def __init__(self, folder: str, record: str) -> None:
        self.folder, self.record = Path(folder) / "rank0", Path(record)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import shutil

        from modules.embedding.ssd_tier.cached_tbe import cached_tbes
        from modules.embedding.table_views import sync_tables

        sync_tables(pl_module.model)
        self.record.mkdir(parents=True, exist_ok=True)
        layout = {}
        for tbe in cached_tbes(pl_module.model):
            first = tbe.table_names[0]
            path = next(f for f in self.folder.glob("*.weights.f32") if f.name.split(".")[0].split("+")[0] == first)
            shutil.copy(path, self.record / path.name)
            layout[path.name] = [[name, int(tbe.weights_offsets[i])] for i, name in enumerate(tbe.table_names)]
        (self.record / "tables.json").write_text(json.dumps(layout))


class CountBroadcasts(Callback):
    """Counts the ``torch.distributed.broadcast`` calls a rank makes from the start of training to its end (the
    function wrapped while it runs) and writes ``{"broadcasts": n, "steps": s}`` to ``<record>-rank<r>.json``."""

    def __init__(self, record: str) -> None:
        self.record, self.calls, self._original = record, 0, None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._original = original = torch.distributed.broadcast

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        torch.distributed.broadcast = counted

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.distributed.broadcast = self._original
        Path(f"{self.record}-rank{trainer.global_rank}.json").write_text(
            json.dumps({"broadcasts": self.calls, "steps": trainer.global_step}))
