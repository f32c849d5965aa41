"""The LightningModule: builds the sharded model, trains it with BCE, evaluates AUC / logloss.

Hyperparameters come from ``optim`` (tuned for ``scaling.base_batch_size``) rescaled to the run's
global batch by ``scaling.rule`` (:mod:`modules.optim.scaling_rules`); CowClip and the per-id embedding L2
term are attached to the sharded model (:mod:`modules.optim.cowclip_hooks`); the learning rates step by step —
warmups, and the factor :class:`pipeline.training.best_validation.BestValidation` lowers on a plateau — are
:mod:`pipeline.training.learning_rates`. Everything else a run does — checkpoint state, k-step merging,
communication accounting, throughput, the row caches' statistics, best-epoch tracking — is a callback
(:mod:`pipeline.training.callbacks`, :mod:`pipeline.checkpoint.training_state`, :mod:`pipeline.training.best_validation`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
import torch
import torch.nn.functional as F

from modules.embedding.table_views import reload_tables, sync_tables
from modules.optim.cowclip_hooks import CowClipHooks, attach_cowclip
from modules.embedding.sparse_arch import is_table_parameter
from modules.optim.embedding_l2 import DecayRule, row_state_bytes
from modules.models import ModelConfig, build_model, onednn_linear
from modules.optim.optimizers import OptimizerChain, build_optimizer, replicated_parameters
from modules.optim.scaling_rules import auto_caveat, scale_hyperparameters
from modules.sharding.comm_precision import qcomm_registry
from modules.sharding.planner import PlanResult, shard_model
from modules.sharding.table_stacking import decide_stacking
from modules.sharding.topology import TopologySpec
from modules.embedding.zch.mapping import load_mapping_state
from pipeline.checkpoint.discovery import read_rank0_state
from pipeline.config import RunConfig
from pipeline.data.batches import CTRBatch
from pipeline.runtime import heap
from pipeline.model_folder.source import ModelSource, model_source
from pipeline.model_folder.weights import read_zch_state
from pipeline.training.init_from import carry_optimizer_state, init_source, initialize_from, reused_positions
from pipeline.training.learning_rates import LearningRates
from pipeline.training.link_choice import LinkSettings
from pipeline.training.metrics import CTRMetrics
from pipeline.training.nonfinite import NonFiniteGuard
from pipeline.training.zch_stage import ZchStage, check_zch_model, table_inits

log = logging.getLogger(__name__)


class CTRTask(L.LightningModule):
    def __init__(self, cfg: RunConfig, topology: TopologySpec, resume_from: str | None = None,
                 init_from: ModelSource | None = None) -> None:
        super().__init__()
        self.resume_from = resume_from  # the checkpoint fit() resumes (trainer.ckpt_path is set only later)
        self.model_cfg = cfg.model
        # trainer.init_from, resolved and checked once per run (the caller's, else here); unused when resuming
        self.init_from = init_from if init_from is not None or resume_from else init_source(cfg.trainer.init_from)
        self.init_from_optimizer = cfg.trainer.init_from_optimizer
        self.topology = topology  # as run: this world's ranks per node and nodes
        self.link = LinkSettings.of(cfg)  # trainer.merging / trainer.comms; `auto` resolved in configure_model
        self.global_batch = cfg.trainer.batch_size
        self.scaled = scale_hyperparameters(cfg.scaling.rule, cfg.trainer.batch_size, cfg.scaling.base_batch_size,
                                            cfg.optim.dense.lr, cfg.optim.embedding.lr, cfg.optim.embedding_l2,
                                            cfg.scaling.embedding_lr, cfg.scaling.warmup_epochs)
        caveat = auto_caveat(cfg.scaling.rule, self.scaled.scale, cfg.optim.embedding.name, cfg.scaling.embedding_lr)
        if caveat:
            log.warning(caveat)
        self.dense_optim = replace(cfg.optim.dense, lr=self.scaled.dense_lr)
        self.embedding_optim = replace(cfg.optim.embedding, lr=self.scaled.embedding_lr)
        self.cowclip_cfg = cfg.scaling.cowclip
        self.l2_scope = cfg.optim.embedding_l2_scope
        self.rates = LearningRates(self.scaled.dense_lr, self.scaled.embedding_lr, self.scaled.warmup_epochs,
                                   cfg.scaling.embedding_warmup_epochs)
        self.nonfinite = NonFiniteGuard(cfg.trainer.nonfinite, lambda: self.link.shard_group(),
                                        cfg.trainer.nonfinite_check_every)
        self.batch_rows = cfg.trainer.local_batches(topology.world_size)  # this rank's: training, evaluation
        self._reused: dict = {}  # init_from: vocabulary positions taken by new values (pipeline.training.init_from)
        self.data_position = (0, 0)  # (epoch, next batch) consumed by training
        self.model: torch.nn.Module | None = None
        self.zch: ZchStage | None = None  # model.zch: raw ids → rows (pipeline/training/zch_stage.py)
        self.plan: PlanResult | None = None
        self.cowclip = CowClipHooks()
        self.val_metrics, self.test_metrics = CTRMetrics(), CTRMetrics()
        self._skip_step = False
        self.onednn_mlp_used = self.overlap_embedding_backward_used = False  # decided in configure_model; logged

    def scaled_hyperparameters(self) -> dict[str, float]:
        return {f"scaled/{k}": v for k, v in asdict(self.scaled).items()}

    # -- model -----------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        data = self.trainer.datamodule
        self.model_cfg = self._stacking_decided(data)
        net = build_model(self.model_cfg, data.feature_spec, device=torch.device("meta"))
        inits = table_inits(net)  # before sharding, which may swap them for the ssd tier's
        device = self.trainer.strategy.root_device
        # a CPU fp32 / bf16-autocast kernel (modules/models/onednn_linear.py): elsewhere the MLP runs PyTorch's layers
        self.onednn_mlp_used = (self.model_cfg.onednn_mlp and onednn_linear.AVAILABLE and device.type == "cpu"
                                and self.trainer.precision in ("32-true", "bf16-mixed"))
        if self.model_cfg.onednn_mlp and not self.onednn_mlp_used:
            log.info("model.onednn_mlp: not used on %s with precision %s (a CPU fp32 or bf16-mixed kernel): the MLP "
                     "runs PyTorch's plain layers", device.type, self.trainer.precision)
        # what modules.models.backward_overlap.applies checks at each forward, decided once for the record
        self.overlap_embedding_backward_used = (self.model_cfg.overlap_embedding_backward and self.onednn_mlp_used
                                                and self.trainer.world_size == 1 and torch.get_num_threads() > 1)
        if self.model_cfg.overlap_embedding_backward and not self.overlap_embedding_backward_used:
            log.info("model.overlap_embedding_backward: not used (it needs the MLP on oneDNN, one process and 2+ "
                     "threads; here %d process(es), %d thread(s))", self.trainer.world_size, torch.get_num_threads())
        spec = data.feature_spec
        ran = read_rank0_state(self.resume_from)["pipeline"]["layout"].get("link") if self.resume_from else None
        self.link = self.link.as_recorded(ran, self.topology) if ran else \
            self.link.resolved(self.model_cfg, spec, net, self.topology, self.global_batch, data.store.split("train"))
        if self.topology.world_size > 1:  # (ctr plan prints the same line itself)
            rank_zero_info(("resumed as the checkpoint ran: " if ran else "") + self.link.describe())
        self.model, self.plan = shard_model(net, self.embedding_optim, self.topology, device,
                                            data_parallel=self.link.dense_in_ddp,
                                            group=self.link.shard_group(),
                                            qcomm=qcomm_registry(self.link.comms), coverage=data.coverage,
                                            table_of={f: spec.table_of(f) for f in spec.sparse},
                                            batch_rows=self.batch_rows[0], eval_rows=self.batch_rows[1],
                                            row_state_bytes=row_state_bytes(self.l2_scope),
                                            # a DDP inside a node (tables per node) crosses no link: fp32 there
                                            dense_precision="fp32" if self.link.copy_span > 1 else self.link.comms.dense)
        if self.model_cfg.zch.enabled:
            check_zch_model(self.model)
            self.zch = ZchStage(self.model_cfg.zch, spec, inits, int(data.store.meta.get("vocabulary_day", 0)))
            if self.init_from and not self.resume_from:  # the same ids on the same rows as the source
                load_mapping_state(self.zch.remapper, read_zch_state(self.init_from))
        if self.init_from and not self.resume_from:  # a resumed run takes its own checkpoint's weights
            store = data.store
            self._reused = reused_positions(store.root / "vocab", int(store.meta.get("vocabulary_day", 0)))
            sync_tables(self.model)  # file-backed tables: every row in the files, the rows not copied too
            initialize_from(self.model, self.init_from, spec, self._reused)
            reload_tables(self.model)
        e = self.embedding_optim
        buckets = data.row_buckets() if self.cowclip_cfg.enabled else None  # only clipped ids are counted
        self.cowclip = attach_cowclip(self.model, self.cowclip_cfg, self.scaled.l2, self.l2_scope,
                                      DecayRule(e.name, self.scaled.l2, e.eps, tuple(e.betas)), buckets)
        self.val_metrics.to(device)
        self.test_metrics.to(device)

    def _stacking_decided(self, data: Any) -> ModelConfig:
        """``model.stack_tables`` decided (:mod:`modules.sharding.table_stacking`). A resumed run, or one started with
        ``trainer.init_from``, keeps the layout of the checkpoint or model it continues under ``auto``: its
        rows and optimizer state then map one to one."""
        source = model_source(self.resume_from, verify=False) if self.resume_from else self.init_from
        if source and self.model_cfg.stack_tables == "auto":
            cfg = replace(self.model_cfg, stack_tables=source.model_cfg.stack_tables)
            why = f"as {source.path}"
        else:
            cfg, why = decide_stacking(self.model_cfg, data.feature_spec, self.topology, self.embedding_optim,
                                       data.coverage, *(n * self.topology.world_size for n in self.batch_rows),
                                       row_state_bytes(self.l2_scope))
        if self.model_cfg.stack_tables == "auto":
            log.info("model.stack_tables=auto: %s (%s)", str(cfg.stack_tables).lower(), why)
        return cfg

    def on_train_start(self) -> None:
        """``trainer.init_from_optimizer``: the source checkpoint's optimizer state, once the optimizers exist."""
        if self.init_from and self.init_from_optimizer != "none" and not self.resume_from:
            sync_tables(self.model)
            carry_optimizer_state(self.model, self.trainer.optimizers[0], self.init_from,
                                  self.trainer.datamodule.feature_spec, self.init_from_optimizer, self._reused)
            reload_tables(self.model)

    def forward(self, batch: CTRBatch) -> torch.Tensor:
        sparse = batch.sparse_features
        if self.zch is not None:
            sparse = self.zch(self.model, sparse, self.cowclip.every_row_l2 and self.cowclip.every_row_l2.lazy,
                              batch.time)
        return self.model(batch.dense_features, sparse)

    def transfer_batch_to_device(self, batch: CTRBatch, device: torch.device, dataloader_idx: int) -> CTRBatch:
        """(On a GPU the loader checked the ids on the host: pipeline/data/batches.py.)"""
        return batch.to(device, non_blocking=True)

    # -- steps -----------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: CTRBatch, batch_idx: int) -> None:
        self.rates.apply_fused(self.model, self.global_step)
        if self.cowclip.every_row_l2 is not None:
            self.cowclip.every_row_l2.begin_step(self.global_step, self.rates.embedding_at(self.global_step))

    def training_step(self, batch: CTRBatch, batch_idx: int) -> torch.Tensor:
        self.data_position = (self.current_epoch, batch_idx + 1)
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self._skip_step = self.nonfinite.bad_loss(loss, self.global_step)
        if self._skip_step:
            return (logits * 0.0).sum()  # zero gradients: every rank still runs the same collectives
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.shape[0])
        if self.zch is not None and (self.global_step + 1) % max(1, self.trainer.log_every_n_steps) == 0:
            self.log_dict(self.zch.metrics())
        return loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Closure (forward + backward), then the dense step — skipped for non-finite values."""
        optimizer_closure()
        if self.cowclip.every_row_l2 is not None:  # on data-parallel tables (embedding_l2_scope=all)
            self.cowclip.every_row_l2.after_backward()
        if not self._skip_step:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
            self._skip_step = self.nonfinite.bad_gradients(grads, self.global_step)
        if self._skip_step:
            optimizer.zero_grad()
        else:
            optimizer.step()
        self.nonfinite.step_done(self.global_step)

    def _eval_step(self, batch: CTRBatch, batch_idx: int, metrics: CTRMetrics) -> None:
        n = batch.valid_rows  # may be 0 on some ranks for the padded last batch: update anyway, so
        # every rank's metric state is defined when torchmetrics syncs it. In fp32 whatever the training precision:
        # the model's weights are fp32, and its AUC is then what ctr predict and ctr serve give (fp32 scoring)
        with torch.autocast(self.device.type, enabled=False):
            logits = self(batch)
        metrics.update(logits[:n], batch.labels[:n])
        if batch_idx % heap.EVERY == heap.EVERY - 1:
            heap.trim()  # freed evaluation blocks back to the system (pipeline/runtime/heap.py)

    def validation_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, self.val_metrics)

    def test_step(self, batch: CTRBatch, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, self.test_metrics)

    def _log_eval(self, prefix: str, metrics: CTRMetrics) -> None:
        for k, v in metrics.compute().items():
            self.log(f"{prefix}/{k}", v, prog_bar=k == "auc", sync_dist=True)
        metrics.reset()

    def on_train_epoch_end(self) -> None:
        self.log("train/skipped_nonfinite_steps", float(self.nonfinite.skipped), sync_dist=True)

    # the every-row L2 term of fused tables is applied lazily: bring every row up to date before the tables
    # are read (evaluation), saved (checkpoint: the state dict holds views of the tables) or handed on
    def _flush_l2(self) -> None:
        if self.cowclip.every_row_l2 is not None:
            self.cowclip.every_row_l2.flush()

    def on_validation_start(self) -> None:
        self.nonfinite.check()  # (trainer.nonfinite=stop: what the steps since the last check noted)
        self._flush_l2()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.nonfinite.check()  # no checkpoint of non-finite weights
        self._flush_l2()
        sync_tables(self.model)  # the ssd tier's files hold every row (the state dict holds views of them)

    def on_train_end(self) -> None:
        self.nonfinite.check()
        self._flush_l2()

    def on_validation_model_train(self) -> None:
        """Back to training mode after validation, every module: Lightning's default restores the modes it
        recorded through ``named_modules``, which does not reach TorchRec's embedding kernels."""
        self.trainer.model.train()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test", self.test_metrics)

    # -- optimizers ------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """Dense parameters, plus embedding tables whose optimizer is not fused into the backward.

        Their rates follow :class:`LearningRates` (warmups, the plateau factor).
        """
        dense, embedding = [], []
        for name, p in replicated_parameters(self.model):  # the fused tables are updated by FBGEMM
            (embedding if is_table_parameter(name) else dense).append(p)
        dense_opt = build_optimizer(self.dense_optim, dense)
        optimizer: torch.optim.Optimizer = dense_opt
        if embedding:
            optimizer = OptimizerChain({"dense": dense_opt, "embedding": build_optimizer(self.embedding_optim, embedding)})
        steps_per_epoch = self.trainer.estimated_stepping_batches / max(1, self.trainer.max_epochs)
        scheduler = self.rates.scheduler(optimizer, len(dense_opt.param_groups), steps_per_epoch)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def set_lr_factor(self, factor: float) -> None:
        """Multiply every base learning rate by ``factor`` from the next step on."""
        self.rates.factor = factor
