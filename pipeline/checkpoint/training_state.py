"""What a resumed run needs beside the weights, added to every checkpoint and restored from it: the
fused optimizer state, the data position, RNG states, the MLflow run id, the non-finite step count,
the run description (:mod:`.run_description`) and the *layout* the checkpoint fits (model config,
table shapes, world size), compared before any tensor is read."""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from modules.embedding.table_views import reload_tables
from pipeline.checkpoint.skeleton import PER_COPY, split_tensors


class TrainingState(Callback):
    """Adds to each checkpoint, and restores from it, what a resumed run needs beside the weights.

    ``live_tensors`` and ``layout`` serve :class:`DCPCheckpointIO` (set up with this callback).
    """

    def __init__(self) -> None:
        self.module: L.LightningModule | None = None
        self.trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.trainer, self.module = trainer, pl_module

    def _fused_state(self) -> dict[str, Any]:
        fused = getattr(self.module.model, "fused_optimizer", None)
        return fused.state_dict()["state"] if fused is not None and fused.param_groups else {}

    def _fused_key(self) -> str:
        """Where the fused optimizer's state goes: ``fused_optimizer``, stored once (sharded), or with copies of the
        tables ``fused_optimizer.copy<c>``, one for each copy (:data:`pipeline.checkpoint.skeleton.PER_COPY`): the
        copies' states differ between merges (only the rows are merged), and under one key the checkpoint would keep
        one copy's for all."""
        span = self.module.link.copy_span
        return f"{PER_COPY}{self.trainer.global_rank // span}" if span else "fused_optimizer"

    def live_tensors(self) -> dict[str, Any]:
        """The module's current tensors a checkpoint is loaded into (model and fused-optimizer state)."""
        live: dict[str, Any] = {}
        split_tensors(self.module.state_dict(), "state_dict", live)
        split_tensors(self._fused_state(), self._fused_key(), live)
        return live

    def layout(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded into this run."""
        plan = self.module.plan
        tables = {name: [p.rows, p.dim] for name, p in sorted(plan.placements.items())} if plan else {}
        return {"model": asdict(self.module.model_cfg), "tables": tables, "world_size": self.trainer.world_size,
                "link": self.module.link.record()}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[self._fused_key()] = self._fused_state()
        datamodule = trainer.datamodule
        checkpoint["pipeline"] = {
            "layout": self.layout(), "data_position": list(pl_module.data_position),
            # what scoring and export need beside the weights: the declaration and the store's vocabularies
            "run": {"model": asdict(pl_module.model_cfg), "data": asdict(datamodule.data_cfg),
                    "store": str(datamodule.store.root)},
            "skipped_nonfinite": pl_module.nonfinite.skipped,
            "mlflow_run_id": getattr(trainer.logger, "run_id", None) if trainer.logger else None,
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_state(np.random.get_state()),
                    "python": _python_rng_state(random.getstate()),
                    **({"cuda": torch.cuda.get_rng_state(pl_module.device)} if pl_module.device.type == "cuda" else {})},
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["pipeline"]
        fused = getattr(pl_module.model, "fused_optimizer", None)
        if fused is not None and checkpoint.get(self._fused_key()):
            sd = fused.state_dict()
            sd["state"] = checkpoint[self._fused_key()]
            fused.load_state_dict(sd)
        reload_tables(pl_module.model)  # read into the ssd tier's files: their row caches start empty
        trainer.datamodule.resume_position = tuple(state["data_position"])
        pl_module.nonfinite.skipped = state["skipped_nonfinite"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(tuple(state["rng"]["numpy"]))
        random.setstate(_python_rng_from(state["rng"]["python"]))
        if "cuda" in state["rng"] and pl_module.device.type == "cuda":  # dropout's masks on the GPU continue too
            torch.cuda.set_rng_state(state["rng"]["cuda"], pl_module.device)

def _numpy_rng_state(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]


def _python_rng_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, torch.tensor(internal, dtype=torch.int64), gauss]


def _python_rng_from(state: list) -> tuple:
    version, internal, gauss = state
    return version, tuple(int(x) for x in internal.tolist()), gauss


def differences(saved: Any, current: Any, path: str = "") -> list[str]:
    """Human-readable differences between two nested layouts."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current), key=str):
            if k not in current:
                out.append(f"{path}{k} only in the checkpoint")
            elif k not in saved:
                out.append(f"{path}{k} only in this run")
            else:
                out += differences(saved[k], current[k], f"{path}{k}.")
        return out
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        saved, current = list(saved), list(current)
    return [] if saved == current else [f"{path.rstrip('.')}: checkpoint {saved!r}, this run {current!r}"]
