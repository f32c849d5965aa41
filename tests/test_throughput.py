"""Training throughput counts every training step's time, also after a validation inside the epoch."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.training.callbacks.throughput import TrainThroughput

STEP_S = 0.05


class SleepyModule(L.LightningModule):
    """Each training step sleeps STEP_S: the callback's seconds are at least steps × STEP_S."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)
        return (self.w * batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Batch:
    def __init__(self, x: torch.Tensor) -> None:
        self.labels = x


# Lightning in this process: its LeafSpec deprecation and its advice on DataLoader workers are not the test's subject
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning", "ignore:.*does not have many workers.*")
def test_time_after_a_mid_epoch_validation_is_counted(tmp_path):
    data = TensorDataset(torch.ones(8, 1))
    callback = TrainThroughput()
    # on_train_batch_end reads batch.labels: wrap each batch
    original = callback.on_train_batch_end
    callback.on_train_batch_end = lambda tr, pl, out, batch, i: original(tr, pl, out, Batch(batch[0]), i)
    trainer = L.Trainer(max_epochs=1, val_check_interval=0.25, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(tmp_path), accelerator="cpu", devices=1)
    trainer.fit(SleepyModule(), DataLoader(data, batch_size=1), DataLoader(data, batch_size=4))
    assert callback.samples == 8
    # 8 steps of at least STEP_S each; before the fix only the 2 steps before the first validation counted
    assert callback.seconds >= 8 * STEP_S, callback.seconds


def test_a_run_resumed_mid_epoch_counts_its_steps_time():
    """Lightning resumes mid-epoch without ``on_train_epoch_start``: the steps still count their time (the
    resumed replicated-tables run reported 4.9M samples/s, its seconds ~0, before the fix)."""
    callback = TrainThroughput()

    class Trainer:
        world_size = 2

    class Module:
        def log(self, *args, **kwargs) -> None:
            self.logged = args

    module = Module()
    for i in range(3):
        callback.on_train_batch_start(Trainer(), module, Batch(torch.ones(4)), i)
        time.sleep(STEP_S)
        callback.on_train_batch_end(Trainer(), module, None, Batch(torch.ones(4)), i)
    callback.on_train_epoch_end(Trainer(), module)
    assert callback.samples == 24 and callback.seconds >= 3 * STEP_S
    assert module.logged[1] == pytest.approx(24 / callback.seconds)


def test_samples_per_s_after_warmup_leaves_out_the_first_steps_and_says_their_time(monkeypatch):
    """A GPU's first steps set up kernels and memory; at batch 65,536 a run has a dozen steps. Steps here take
    1 s each, the first three 10 s: the figure after warm-up is 4 samples/s, the whole run's far less."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    callback = TrainThroughput(warmup_steps=3)

    class Trainer:
        world_size = 1

    module = object()
    for i, seconds in enumerate([10, 10, 10, 1, 1, 1, 1]):
        callback.on_train_batch_start(Trainer(), module, Batch(torch.ones(4)), i)
        clock[0] += seconds
        callback.on_train_batch_end(Trainer(), module, None, Batch(torch.ones(4)), i)
    assert callback.warmup_s == 30 and callback.samples_per_s_after_warmup == pytest.approx(16 / 4)
    callback._stop()  # (the epoch's end)
    assert callback.samples_per_s == pytest.approx(28 / 34)
    assert TrainThroughput(warmup_steps=3).samples_per_s_after_warmup is None  # no step after the warm-up
