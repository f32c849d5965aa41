"""What CowClip does, logged: the share of clipped (id, step) pairs, per epoch and per id-frequency
bucket, and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from modules.host_collectives import host_group
from modules.optim.cowclip import BUCKET_LABELS


class CowClipLogging(Callback):
    """What CowClip does (the statistics the attached hooks fill, ``CTRTask.cowclip``):

    * ``train/cowclip_clipped_fraction`` per epoch: the share of (id, step) pairs whose gradient CowClip
      scaled down;
    * every ``trainer.log_every_n_steps`` steps, that share per id-frequency bucket (the id's occurrences
      in the training data, :data:`modules.optim.cowclip.BUCKET_LABELS`) since the last log,
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
            torch.distributed.all_reduce(both, group=host_group())  # host counts (modules/host_collectives.py)
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
