"""Lightning strategy for TorchRec models.

Lightning's ``DDPStrategy`` gives process-group setup (torchrun / single process), barriers and
metric reduction. What it must not do with a ``DistributedModelParallel`` model (see DESIGN §4):
wrap it in DDP (DMP already wraps the dense part), move it (DMP placed every shard on its device),
or broadcast rank 0's parameters before evaluation (the embedding shards differ per rank).
"""

from __future__ import annotations

import lightning as L
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn


class TorchRecStrategy(DDPStrategy):
    strategy_name = "torchrec_ddp"

    def setup(self, trainer: "L.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        """The LightningModule builds its DMP on ``root_device`` in ``configure_model``."""

    def configure_ddp(self) -> None:
        """DMP wraps the dense modules in DDP itself."""
