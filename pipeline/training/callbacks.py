"""Lightning callbacks of the pipeline: throughput, communication accounting, k-step merging,
CowClip statistics and sharded checkpoints. Order matters where a step's work feeds the next one:
:func:`pipeline.commands.train.build_callbacks` lists them in the order they must run after each training step (merge, then
count the bytes, then checkpoint)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence, TypeVar

import lightning as L
import torch
from filelock import FileLock, Timeout
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from modules.comm_accounting import CommCounter, ddp_counting_hook
from modules.cowclip import BUCKET_LABELS
from modules.kstep_merging import KStepMerger, MergeConfig
from modules.optimizers import replicated_parameters
from pipeline.checkpoint.checkpointing import CheckpointMismatchError, complete_checkpoints

C = TypeVar("C", bound=Callback)


def find_callback(callbacks: Sequence[Callback], cls: type[C]) -> C | None:
    """The run's callback of type ``cls`` (None if it has none)."""
    return next((c for c in callbacks if isinstance(c, cls)), None)


class TrainThroughput(Callback):
    """Training samples per second (all ranks), validation time excluded.

    Logs ``train/samples_per_s`` per epoch; ``samples_per_s`` holds the whole run's figure.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._epoch_samples = 0
        self._epoch_seconds = 0.0
        self._t0: float | None = None

    def _start(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def _stop(self) -> None:
        if self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self._epoch_seconds += dt
            self.seconds += dt
            self._t0 = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_samples, self._epoch_seconds = 0, 0.0
        self._start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        n = int(batch.labels.shape[0]) * trainer.world_size
        self.samples += n
        self._epoch_samples += n

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training:
            self._start()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        if self._epoch_seconds:
            pl_module.log("train/samples_per_s", self._epoch_samples / self._epoch_seconds, sync_dist=True)


class KStepMerging(Callback):
    """k-step model merging of the replicated parameters (:mod:`modules.kstep_merging`): after every
    training step, and a final merge before validation, testing, checkpoints and at each epoch's end.
    Its step and merge counters are saved with checkpoints."""

    def __init__(self, cfg: MergeConfig, ranks_per_node: int) -> None:
        self.cfg, self.ranks_per_node = cfg, ranks_per_node
        self.merger: KStepMerger | None = None
        self._counters = {"steps": 0, "merges": 0}

    def state_dict(self) -> dict[str, Any]:
        return self._counters if self.merger is None else {"steps": self.merger.steps, "merges": self.merger.merges}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counters = dict(state)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = [p for _, p in replicated_parameters(pl_module.model)]
        self.merger = KStepMerger(params, self.cfg, ranks_per_node=self.ranks_per_node)
        self.merger.steps, self.merger.merges = self._counters["steps"], self._counters["merges"]
        self.merger.attach_optimizer(trainer.optimizers[0])

    def merge_if_dirty(self) -> None:
        if self.merger is not None:
            self.merger.merge_if_dirty()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.merger.after_step()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.merge_if_dirty()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.merge_if_dirty()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.merge_if_dirty()


class CommAccounting(Callback):
    """Bytes of the collectives issued during training steps, by category (:mod:`modules.comm_accounting`);
    logs ``comm/<category>_bytes_per_step`` and ``comm/total_bytes_per_step`` at each epoch's end."""

    def __init__(self) -> None:
        self.counter = CommCounter()
        self.steps = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dense = getattr(pl_module.model, "_dmp_wrapped_module", None)
        if isinstance(dense, DistributedDataParallel):  # DDP's all-reduce runs in C++: counted by a comm hook
            dense.register_comm_hook(None, ddp_counting_hook)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.counter.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.counter.stop()
        self.steps += 1

    def bytes_per_step(self) -> dict[str, float]:
        steps = max(1, self.steps)
        out = {f"comm/{k}_bytes_per_step": v / steps for k, v in self.counter.bytes.items()}
        out["comm/total_bytes_per_step"] = sum(self.counter.bytes.values()) / steps
        return out

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for k, v in self.bytes_per_step().items():
            pl_module.log(k, v, sync_dist=True)


class CowClipLogging(Callback):
    """What CowClip does (the statistics the attached hooks fill, ``CTRTask.cowclip``):

    * ``train/cowclip_clipped_fraction`` per epoch: the share of (id, step) pairs whose gradient CowClip
      scaled down;
    * every ``trainer.log_every_n_steps`` steps, that share per id-frequency bucket (the id's occurrences
      in the training data, :data:`modules.cowclip.BUCKET_LABELS`) since the last log,
      ``train/cowclip_clipped_fraction/<bucket>``, summed over the ranks; at the end of training a plot
      of it over the steps, ``cowclip_clipped_by_frequency.png`` in the output folder and the MLflow run.
    """

    PLOT = "cowclip_clipped_by_frequency.png"

    def __init__(self) -> None:
        self.history: list[tuple[int, list[float | None]]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        clipped = pl_module.cowclip.stats.take()
        if clipped is not None:
            pl_module.log("train/cowclip_clipped_fraction", clipped, sync_dist=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % trainer.log_every_n_steps:
            return
        seen, clipped = pl_module.cowclip.stats.take_buckets()
        if trainer.world_size > 1:
            both = torch.stack([seen, clipped])
            torch.distributed.all_reduce(both)
            seen, clipped = both
        if int(seen.sum()) == 0:
            return
        shares = [int(c) / int(n) if int(n) else None for n, c in zip(seen, clipped)]
        self.history.append((trainer.global_step, shares))
        if trainer.logger is not None:
            trainer.logger.log_metrics({f"train/cowclip_clipped_fraction/{label}": v
                                        for label, v in zip(BUCKET_LABELS, shares) if v is not None},
                                       step=trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.history or not trainer.is_global_zero:
            return
        path = plot_clipping(self.history, Path(trainer.default_root_dir) / self.PLOT)
        logger = trainer.logger
        if logger is not None and getattr(logger, "run_id", None):
            logger.experiment.log_artifact(logger.run_id, str(path))


def plot_clipping(history: list[tuple[int, list[float | None]]], path: Path) -> Path:
    """Share of (id, step) pairs clipped over the training steps, a line per id-frequency bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for b, label in enumerate(BUCKET_LABELS):
        points = [(step, shares[b]) for step, shares in history if shares[b] is not None]
        if points:
            ax.plot(*zip(*points), label=label, marker=".", linewidth=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("share of (id, step) pairs clipped")
    ax.set_title("CowClip by id frequency (occurrences in the training data)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class ShardedCheckpoint(Callback):
    """Checkpoints every ``every_n_steps`` training steps and at the end of every epoch, keeping the
    newest ``keep`` (see :mod:`pipeline.checkpoint.checkpointing`). Replicas are merged first (k-step merging).

    The folder belongs to one run at a time: global rank 0 holds a lock file in it (``.lock``, released
    when the process ends, however it ends); a second run naming the same folder is refused."""

    def __init__(self, dirpath: str, every_n_steps: int | None = None, keep: int = 2) -> None:
        self.dirpath, self.every_n_steps, self.keep = dirpath, every_n_steps, max(1, keep)
        self._saved_step: int | None = None
        self._lock: FileLock | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self._lock is None:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(Path(self.dirpath) / ".lock"))
            try:
                self._lock.acquire(timeout=0)
            except Timeout:
                self._lock = None
                raise CheckpointMismatchError(f"trainer.checkpoint.dir={self.dirpath} is in use by another running "
                                              f"job; give this run its own folder") from None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._lock is not None and stage == "fit":
            self._lock.release()
            self._lock = None

    def save(self, trainer: L.Trainer) -> None:
        """A checkpoint of this step, unless one was just written (epoch end after a step's, preemption)."""
        if self._saved_step == trainer.global_step:
            return
        self._saved_step = trainer.global_step
        merging = find_callback(trainer.callbacks, KStepMerging)
        if merging is not None:
            merging.merge_if_dirty()
        trainer.save_checkpoint(str(Path(self.dirpath) / f"step-{trainer.global_step:09d}"))
        if trainer.is_global_zero:
            for old in complete_checkpoints(self.dirpath)[:-self.keep]:
                trainer.strategy.checkpoint_io.remove_checkpoint(old)
        trainer.strategy.barrier("checkpoint pruning")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)
