"""Lightning strategy for TorchRec models.

Lightning's ``DDPStrategy`` gives process-group setup (torchrun / single process), barriers and
metric reduction. What it must not do with a ``DistributedModelParallel`` model (see DESIGN §4):
wrap it in DDP (DMP already wraps the dense part), move it (DMP placed every shard on its device),
or broadcast rank 0's parameters before evaluation (the embedding shards differ per rank).
Nor may it move the module to the CPU when ``fit`` ends (Lightning's ``teardown``): the run tests the same model
on its device afterwards. Checkpoints are written by every rank (each holds its own shards; see
:mod:`pipeline.checkpoint.dcp_io`), not by rank 0 alone.

Under ``torchrun`` the process group is made in a store of its own for each start of the workers
(:mod:`pipeline.runtime.start_store`: torchrun's one store for the whole job would hand a restarted
rank the addresses of the killed start's peers). Collectives, and that store, wait at most
``trainer.collective_timeout_s``.
"""

from __future__ import annotations

import lightning as L
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from modules import host_collectives
from modules.embedding.table_views import reload_tables
from pipeline.checkpoint.full_state import without_doubled_prefix
from pipeline.runtime.peers import Peers
from pipeline.runtime.start_store import agent_store_used, start_store


class TorchRecStrategy(DDPStrategy):
    strategy_name = "torchrec_ddp"
    peers: Peers | None = None

    def setup(self, trainer: "L.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.model_to_device()

    def teardown(self) -> None:
        """Lightning's, less its moves: ``Strategy.teardown`` moves the optimizers' state and the module to the CPU
        when ``fit`` ends (to free device memory), and the run then tests on that module (``run.py``). The model's
        FBGEMM tables, their UVM caches and optimizer state live where DMP placed them, and nothing moves them back:
        everything stays on its device, and the process's end frees it."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def setup_distributed(self) -> None:
        if agent_store_used() and not dist.is_initialized():
            self.set_world_ranks()
            _init_dist_connection(self.cluster_environment, self._get_process_group_backend(), timeout=self._timeout,
                                  device_id=self.root_device if self.root_device.type != "cpu" else None,
                                  store=start_store(self.global_rank, self._timeout))
        super().setup_distributed()  # seeds and ranks; Lightning's own process group if none was made above
        host_collectives.start(self._timeout)  # the gloo twin host tensors travel on (NCCL takes device tensors)
        self.peers = Peers.exchange()  # to name a lost peer if a collective fails (pipeline/runtime/peers.py)

    def model_to_device(self) -> None:
        """Nothing moves: the LightningModule builds its DMP on ``root_device`` in ``configure_model``. The module's
        ``device`` is set, where Lightning makes its logged numbers and reduces them (``sync_dist``)."""
        self.lightning_module._device = self.root_device

    def configure_ddp(self) -> None:
        """DMP wraps the dense modules in DDP itself."""

    def save_checkpoint(self, checkpoint: dict, filepath: str, storage_options: object = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None:
        """Through DMP's own ``load_state_dict``: a parent module's would see DMP's wrapper prefixes."""
        module = self.lightning_module
        state = checkpoint["state_dict"]
        model_state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        module.model.load_state_dict(without_doubled_prefix(model_state), strict=strict)
        rest = {k: v for k, v in state.items() if not k.startswith("model.")}
        if rest:
            missing, unexpected = module.load_state_dict(rest, strict=False)
            if strict and unexpected:
                raise RuntimeError(f"unexpected keys in the checkpoint: {unexpected}")
        reload_tables(module.model)  # the checkpoint was read into the ssd tier's files: their caches start empty

    def remove_checkpoint(self, filepath: str) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
        self.barrier("remove_checkpoint")
