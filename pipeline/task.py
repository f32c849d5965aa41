"""The LightningModule: builds the sharded model, trains with BCE, evaluates AUC / logloss.

Hyperparameters come from ``optim`` (tuned for ``scaling.base_batch_size``) rescaled to the run's
global batch by ``scaling.rule``; CowClip and the per-id embedding L2 term are installed on the
sharded model; the dense learning rate warms up linearly over ``scaling.warmup_epochs``. With
``plateau_lr_factor``, every ``plateau_patience`` validations in a row that do not improve the best
AUC multiply all learning rates (dense, data-parallel and fused embedding optimizers) by that
factor (FuxiCTR's reduce-LR-on-plateau has patience 1).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Mapping

import lightning as L
import torch
import torch.nn.functional as F

from torch.nn.parallel import DistributedDataParallel

from modules.comm_accounting import CommCounter, ddp_counting_hook
from modules.cowclip import CowClipConfig
from modules.cowclip_placement import install_cowclip
from modules.models import build_model
from modules.kstep_merging import KStepMerger, MergeConfig
from modules.optimizers import OptimizerChain, OptimizerSpec, build_optimizer
from modules.scaling_rules import ScaledHyperparameters, scale_hyperparameters, warmup_factor
from modules.sharding import shard_model
from pipeline.data.batches import CTRBatch
from pipeline.metrics import CTRMetrics


class CTRTask(L.LightningModule):
    def __init__(self, model: Mapping[str, Any], optim: Mapping[str, Any], topology: Mapping[str, Any],
                 scaling: Mapping[str, Any], batch_size: int, plateau_lr_factor: float | None = None,
                 merging: Mapping[str, Any] | None = None, plateau_patience: int = 1, nonfinite: str = "stop",
                 debug: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.model_cfg = dict(model)
        dense = OptimizerSpec.from_mapping(optim["dense"], "optim.dense")
        embedding = OptimizerSpec.from_mapping(optim["embedding"], "optim.embedding")
        self.scaled: ScaledHyperparameters = scale_hyperparameters(
            scaling["rule"], batch_size, scaling["base_batch_size"], dense.lr, embedding.lr,
            float(optim.get("embedding_l2", 0.0)))
        self.dense_optim = replace(dense, lr=self.scaled.dense_lr)
        self.embedding_optim = replace(embedding, lr=self.scaled.embedding_lr)
        self.cowclip = CowClipConfig.from_mapping(scaling["cowclip"], l2=self.scaled.l2)
        self.warmup_epochs = float(scaling.get("warmup_epochs", 0))
        self.plateau_lr_factor = plateau_lr_factor
        self.plateau_patience = max(1, int(plateau_patience))
        self.stale_validations = 0
        self.lr_factor = 1.0
        self.best_val_auc: float | None = None
        if nonfinite not in ("stop", "skip"):
            raise ValueError(f"trainer.nonfinite={nonfinite!r}: expected 'stop' or 'skip'")
        self.nonfinite = nonfinite
        self.skipped_nonfinite = 0
        self._skip_step = False
        self.debug = dict(debug or {})
        self.data_position = (0, 0)  # (epoch, next batch) consumed by training
        self.resumed = False
        self.topology = dict(topology)
        self.model: torch.nn.Module | None = None
        self.plan = None
        self.cowclip_tables: dict[str, set[str]] = {}
        self.cowclip_stats = None
        self.merge_cfg = MergeConfig(**merging) if merging and merging.get("k") else None
        self.merger: KStepMerger | None = None
        self.comm = CommCounter()
        self.comm_steps = 0
        self.val_metrics = CTRMetrics()
        self.test_metrics = CTRMetrics()

    # -- checkpoint state (pipeline.checkpointing) ------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded into this run."""
        tables = {name: [p.rows, p.dim] for name, p in sorted(self.plan.placements.items())} if self.plan else {}
        return {"model": {k: v for k, v in self.model_cfg.items()}, "tables": tables,
                "world_size": self.trainer.world_size, "merging": self.merge_cfg is not None}

    def _fused_state(self) -> dict[str, Any]:
        fused = getattr(self.model, "fused_optimizer", None)
        return fused.state_dict()["state"] if fused is not None and fused.param_groups else {}

    def checkpoint_tensors(self) -> dict[str, Any]:
        """The live tensors a checkpoint is loaded into (model and fused-optimizer state)."""
        from pipeline.checkpointing import split_tensors

        live: dict[str, Any] = {}
        split_tensors(self.state_dict(), "state_dict", live)
        split_tensors(self._fused_state(), "fused_optimizer", live)
        return live

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        import random

        import numpy as np

        checkpoint["fused_optimizer"] = self._fused_state()
        logger = self.logger
        checkpoint["pipeline"] = {
            "layout": self.layout(), "lr_factor": self.lr_factor, "best_val_auc": self.best_val_auc,
            "stale_validations": self.stale_validations, "skipped_nonfinite": self.skipped_nonfinite,
            "merger": None if self.merger is None else {"steps": self.merger.steps, "merges": self.merger.merges},
            "data_position": list(self.data_position),
            "mlflow_run_id": getattr(logger, "run_id", None) if logger else None,
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_state(np.random.get_state()),
                    "python": _python_rng_state(random.getstate())},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        import random

        import numpy as np

        from pipeline.checkpointing import CheckpointMismatchError

        state = checkpoint["pipeline"]
        self.resumed = True
        differs = _differences(state["layout"], self.layout())
        if differs:
            raise CheckpointMismatchError("the checkpoint does not match this run: " + "; ".join(differs))
        fused = getattr(self.model, "fused_optimizer", None)
        if fused is not None and checkpoint.get("fused_optimizer"):
            sd = fused.state_dict()
            sd["state"] = checkpoint["fused_optimizer"]
            fused.load_state_dict(sd)
        self.trainer.datamodule.resume_position = tuple(state["data_position"])
        self.lr_factor, self.best_val_auc = state["lr_factor"], state["best_val_auc"]
        self.stale_validations, self.skipped_nonfinite = state["stale_validations"], state["skipped_nonfinite"]
        if self.merger is not None and state["merger"]:
            self.merger.steps, self.merger.merges = state["merger"]["steps"], state["merger"]["merges"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(tuple(state["rng"]["numpy"]))
        random.setstate(_python_rng_from(state["rng"]["python"]))

    def scaled_hyperparameters(self) -> dict[str, float]:
        return {f"scaled/{k}": v for k, v in asdict(self.scaled).items()}

    # -- model -----------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        spec = self.trainer.datamodule.feature_spec
        params = {k: v for k, v in self.model_cfg.items() if k != "name"}
        net = build_model(self.model_cfg["name"], spec, params, device=torch.device("meta"))
        device = self.trainer.strategy.root_device
        self.model, self.plan = shard_model(net, self.embedding_optim, self.topology, device,
                                            data_parallel=self.merge_cfg is None,
                                            coverage=self.trainer.datamodule.coverage)
        self.cowclip_tables, self.cowclip_stats = install_cowclip(self.model, self.cowclip)
        if self.merge_cfg is not None:
            replicated = [p for p in self.model.parameters() if not getattr(p, "_in_backward_optimizers", None)]
            per_node = int(self.topology.get("ranks_per_node") or self.trainer.num_devices)
            self.merger = KStepMerger(replicated, self.merge_cfg, ranks_per_node=per_node)
        elif isinstance(self.model._dmp_wrapped_module, DistributedDataParallel):
            self.model._dmp_wrapped_module.register_comm_hook(None, ddp_counting_hook)
        self.val_metrics.to(device)
        self.test_metrics.to(device)

    def forward(self, batch: CTRBatch) -> torch.Tensor:
        return self.model(batch.dense_features, batch.sparse_features)

    def transfer_batch_to_device(self, batch: CTRBatch, device: torch.device, dataloader_idx: int) -> CTRBatch:
        return batch.to(device, non_blocking=True)

    # -- steps -----------------------------------------------------------------------------------
    def training_step(self, batch: CTRBatch, batch_idx: int) -> torch.Tensor:
        self.data_position = (self.current_epoch, batch_idx + 1)
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        if self.debug.get("inject_nan_at_step") == self.global_step:
            loss = loss * float("nan")
        self._skip_step = False
        if self._anywhere(~torch.isfinite(loss)):
            self._non_finite(f"the loss is {loss.item()} at step {self.global_step} (epoch {self.current_epoch}, "
                             f"batch {batch_idx})")
            return (logits * 0.0).sum()  # zero gradients: every rank still runs the same collectives
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.shape[0])
        return loss

    def _anywhere(self, flag: torch.Tensor) -> bool:
        """True if ``flag`` holds on any rank (all ranks must take the same branch)."""
        flag = flag.detach().to(torch.float32).reshape(1)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _non_finite(self, what: str) -> None:
        if self.nonfinite == "stop":
            raise FloatingPointError(f"Non-finite training: {what}. Set trainer.nonfinite=skip to skip such steps "
                                     f"(they are counted as train/skipped_nonfinite_steps).")
        self.skipped_nonfinite += 1
        self._skip_step = True

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Closure (forward + backward), then the step — skipped for non-finite values — and k-step
        merging. Everything a step changes is done here, before any callback (checkpoints) runs."""
        optimizer_closure()
        if not self._skip_step:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any() if grads else torch.tensor(False)
            if self._anywhere(bad):
                self._non_finite(f"non-finite dense gradients at step {self.global_step} (epoch {epoch}, "
                                 f"batch {batch_idx}); embedding tables were already updated in the backward")
        if self._skip_step:
            optimizer.zero_grad()
        else:
            optimizer.step()
        if self.merger is not None:
            self.merger.after_step()
        self.comm.stop()
        self.comm_steps += 1

    def _eval_step(self, batch: CTRBatch, metrics: CTRMetrics) -> None:
        n = batch.valid_rows  # may be 0 on some ranks for the padded last batch: update anyway, so
        logits = self(batch)   # every rank's metric state is defined when torchmetrics syncs it
        metrics.update(logits[:n], batch.labels[:n])

    def validation_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics)

    def test_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics)

    def _log_eval(self, prefix: str, metrics: CTRMetrics) -> None:
        for k, v in metrics.compute().items():
            self.log(f"{prefix}/{k}", v, prog_bar=k == "auc", sync_dist=True)
        metrics.reset()

    # -- merging and communication accounting ----------------------------------------------------
    def on_train_batch_start(self, batch: CTRBatch, batch_idx: int) -> None:
        self.comm.start()

    def merge_replicas(self) -> None:
        """Make the replicated parameters identical on every rank (no-op without k-step merging)."""
        if self.merger is not None:
            self.merger.merge_if_dirty()

    def on_validation_start(self) -> None:
        self.merge_replicas()

    def on_test_start(self) -> None:
        self.merge_replicas()

    def comm_bytes_per_step(self) -> dict[str, float]:
        steps = max(1, self.comm_steps)
        out = {f"comm/{k}_bytes_per_step": v / steps for k, v in self.comm.bytes.items()}
        out["comm/total_bytes_per_step"] = sum(self.comm.bytes.values()) / steps
        return out

    def on_train_epoch_end(self) -> None:
        self.merge_replicas()
        self.log("train/skipped_nonfinite_steps", float(self.skipped_nonfinite), sync_dist=True)
        for k, v in self.comm_bytes_per_step().items():
            self.log(k, v, sync_dist=True)
        clipped = self.cowclip_stats.take() if self.cowclip_stats is not None else None
        if clipped is not None:  # share of (id, step) pairs whose gradient CowClip scaled down
            self.log("train/cowclip_clipped_fraction", clipped, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        auc = self.val_metrics.compute()["auc"]  # identical on every rank (synced)
        self._log_eval("val", self.val_metrics)
        if self.trainer.sanity_checking:
            return
        if self.best_val_auc is None or auc > self.best_val_auc:
            self.best_val_auc, self.stale_validations = auc, 0
            return self.log("train/lr_factor", self.lr_factor, sync_dist=True)
        self.stale_validations += 1
        if self.plateau_lr_factor and self.stale_validations >= self.plateau_patience:
            self.lr_factor *= self.plateau_lr_factor
            self.stale_validations = 0
            self._set_fused_lr(self.embedding_optim.lr * self.lr_factor)
        self.log("train/lr_factor", self.lr_factor, sync_dist=True)

    def _set_fused_lr(self, lr: float) -> None:
        fused = getattr(self.model, "fused_optimizer", None)
        if fused is None or not fused.param_groups:
            return
        for group in fused.param_groups:
            group["lr"] = lr
        fused.step()  # TorchRec's fused optimizers hand the new rate to FBGEMM here

    def on_test_epoch_end(self) -> None:
        self._log_eval("test", self.test_metrics)

    # -- optimizers ------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """Dense parameters, plus embedding tables whose optimizer is not fused into the backward.

        The warmup schedule scales the dense groups only (embedding LRs stay as the rule set them).
        """
        dense, embedding = [], []
        for name, p in self.model.named_parameters():
            if getattr(p, "_in_backward_optimizers", None):
                continue  # updated by FBGEMM inside the backward
            (embedding if ".embedding_bags." in name else dense).append(p)
        dense_opt = build_optimizer(self.dense_optim, dense)
        optimizer: torch.optim.Optimizer = dense_opt
        if embedding:
            optimizer = OptimizerChain({"dense": dense_opt, "embedding": build_optimizer(self.embedding_optim, embedding)})
        steps_per_epoch = self.trainer.estimated_stepping_batches / max(1, self.trainer.max_epochs)
        warmup_steps = int(round(self.warmup_epochs * steps_per_epoch))
        n_dense = len(dense_opt.param_groups)
        lambdas = [lambda step: warmup_factor(step, warmup_steps) * self.lr_factor] * n_dense + \
                  [lambda step: self.lr_factor] * (len(optimizer.param_groups) - n_dense)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        if self.merger is not None:
            self.merger.attach_optimizer(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _numpy_rng_state(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]


def _python_rng_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, torch.tensor(internal, dtype=torch.int64), gauss]


def _python_rng_from(state: list) -> tuple:
    version, internal, gauss = state
    return version, tuple(int(x) for x in internal.tolist()), gauss


def _differences(saved: Any, current: Any, path: str = "") -> list[str]:
    """Human-readable differences between two nested layouts."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current), key=str):
            if k not in current:
                out.append(f"{path}{k} only in the checkpoint")
            elif k not in saved:
                out.append(f"{path}{k} only in this run")
            else:
                out += _differences(saved[k], current[k], f"{path}{k}.")
        return out
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        saved, current = list(saved), list(current)
    return [] if saved == current else [f"{path.rstrip('.')}: checkpoint {saved!r}, this run {current!r}"]
