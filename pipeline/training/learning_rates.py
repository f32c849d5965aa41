"""A run's learning rates step by step: the rule's rates for the run's batch (:mod:`modules.optim.scaling_rules`),
each warmed up linearly over its own epochs, times ``factor`` (lowered on a plateau by
:class:`pipeline.training.best_validation.BestValidation`)::

    dense_lr(t)     = dense_lr     · min(1, (t + 1) / W_dense) · factor       W_dense = scaling.warmup_epochs · steps/epoch
    embedding_lr(t) = embedding_lr · min(1, (t + 1) / W_emb)   · factor       W_emb   = scaling.embedding_warmup_epochs · …

torch's optimizers (the dense parameters, data-parallel tables) follow them through a ``LambdaLR``; the tables whose
optimizer FBGEMM fuses into the backward get the embedding rate handed to FBGEMM before any step where it changed
(:meth:`LearningRates.apply_fused`: TorchRec's fused optimizer passes a param group's ``lr`` on in ``step()``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modules.optim.scaling_rules import warmup_factor


@dataclass
class LearningRates:
    dense: float
    embedding: float
    dense_warmup_epochs: float = 0.0
    embedding_warmup_epochs: float = 0.0
    factor: float = 1.0
    steps_per_epoch: float = 1.0     # set when the optimizers are built (the trainer knows it then)
    _fused: float | None = None      # the rate FBGEMM has now

    def _warmup_steps(self, epochs: float) -> int:
        return int(round(epochs * self.steps_per_epoch))

    def dense_at(self, step: int) -> float:
        return self.dense * warmup_factor(step, self._warmup_steps(self.dense_warmup_epochs)) * self.factor

    def embedding_at(self, step: int) -> float:
        return self.embedding * warmup_factor(step, self._warmup_steps(self.embedding_warmup_epochs)) * self.factor

    def scheduler(self, optimizer: torch.optim.Optimizer, dense_groups: int,
                  steps_per_epoch: float) -> torch.optim.lr_scheduler.LambdaLR:
        """Multipliers of the groups' base rates: the first ``dense_groups`` follow the dense rate, the rest
        (non-fused tables) the embedding rate."""
        self.steps_per_epoch = steps_per_epoch
        dense = [lambda step: self.dense_at(step) / self.dense if self.dense else 0.0] * dense_groups
        embedding = [lambda step: self.embedding_at(step) / self.embedding if self.embedding else 0.0] * \
            (len(optimizer.param_groups) - dense_groups)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, dense + embedding)

    def apply_fused(self, model: torch.nn.Module | None, step: int) -> None:
        """Hand step ``step``'s embedding rate to the fused tables of ``model`` if it changed."""
        lr = self.embedding_at(step)
        fused = getattr(model, "fused_optimizer", None)
        if lr == self._fused or fused is None or not fused.param_groups:
            return
        for group in fused.param_groups:
            group["lr"] = lr
        fused.step()  # TorchRec's fused optimizers pass the new rate to FBGEMM here (no update: that ran in backward)
        self._fused = lr
