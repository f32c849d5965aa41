"""The non-finite policy (pipeline/training/nonfinite.py) and the best-validation bookkeeping
(pipeline/training/best_validation.py), on their own; end to end in test_checkpointing.py."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from pipeline.training.best_validation import BestValidation
from pipeline.training.nonfinite import NonFiniteGuard


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_stop_names_the_first_bad_step_and_its_value_at_the_next_check(value):
    guard = NonFiniteGuard("stop", check_every=4)
    for step in range(3):
        assert not guard.bad_loss(torch.tensor(0.5 if step != 1 else value), step)
        guard.step_done(step)  # steps 0..2: no read yet
    with pytest.raises(FloatingPointError, match=f"the loss is {value} at step 1"):
        guard.step_done(3)
    assert guard.skipped == 0


def test_stop_reads_the_flags_once_every_n_steps_not_twice_a_step(monkeypatch):
    """On a GPU each read waits for the device: 10 steps with check_every=4 read twice (after steps 3 and 7), and the
    check before a checkpoint or the end once more; the old guard read twice a step (20)."""
    import pipeline.training.nonfinite as nonfinite
    reads = []
    real = nonfinite.anywhere
    monkeypatch.setattr(nonfinite, "anywhere", lambda flag, group=None: reads.append(1) or real(flag, group))
    guard = NonFiniteGuard("stop", check_every=4)
    for step in range(10):
        guard.bad_loss(torch.tensor(0.5), step)
        guard.bad_gradients([torch.ones(3), torch.zeros(2)], step)
        guard.step_done(step)
    assert len(reads) == 2
    guard.check()
    assert len(reads) == 3
    guard.bad_gradients([torch.tensor([1.0, math.nan])], 10)
    guard.bad_loss(torch.tensor(math.inf), 11)  # later: the message names the first
    with pytest.raises(FloatingPointError, match="non-finite dense gradients at step 10"):
        guard.check()


def test_skip_counts_bad_losses_and_gradients_only():
    guard = NonFiniteGuard("skip")
    assert not guard.bad_loss(torch.tensor(0.3), 0)
    assert guard.bad_loss(torch.tensor(math.nan), 1)
    assert not guard.bad_gradients([torch.ones(3), None, torch.zeros(2, 2)], 2)
    assert guard.bad_gradients([torch.ones(3), torch.tensor([1.0, math.inf])], 3)
    assert not guard.bad_gradients([None], 4)  # nothing to check
    assert guard.skipped == 2


def _two_ranks(rank: int, world: int) -> None:
    from modules.comm_accounting import CommCounter, install
    from modules.sharding.replicated_tables import copy_group

    own = copy_group(1, timedelta(seconds=120))
    install()  # in this worker process, which ends with the test
    counter = CommCounter()
    loss = torch.tensor(math.nan if rank == 1 else 0.5)
    counter.start()
    together = NonFiniteGuard("skip").bad_loss(loss, 3)
    counted = sum(counter.bytes.values())
    alone = NonFiniteGuard("skip", group=lambda: own).bad_loss(loss, 3)
    counter.stop()
    assert together and counted == 4  # the flag all-reduced: both ranks skip
    assert alone == (rank == 1) and sum(counter.bytes.values()) == counted  # each decides for itself: no collective


def test_ranks_decide_together_over_the_group_a_step_spans():
    from tests.dist_utils import run_workers

    run_workers(_two_ranks, 2)


def test_unknown_policy_names_the_key():
    with pytest.raises(ValueError, match="trainer.nonfinite='ignore'"):
        NonFiniteGuard("ignore")


class _Trainer:
    def __init__(self) -> None:
        self.sanity_checking, self.current_epoch, self.global_step = False, 0, 0
        self.callback_metrics: dict = {}
        self.loggers: list = []
        self.should_stop = False


class _Module:
    def __init__(self) -> None:
        self.factors: list[float] = []

    def set_lr_factor(self, factor: float) -> None:
        self.factors.append(factor)


def _validate(cb: BestValidation, trainer: _Trainer, module: _Module, aucs: list[float]) -> list[tuple]:
    """Feed validation AUCs epoch by epoch; (lr factor, stop?) after each."""
    out = []
    for epoch, auc in enumerate(aucs):
        trainer.current_epoch, trainer.callback_metrics = epoch, {"val/auc": torch.tensor(auc)}
        cb.on_validation_end(trainer, module)
        out.append((cb.lr_factor, trainer.should_stop))
    return out


def test_plateau_and_early_stopping_follow_their_patience():
    # reference, by hand: best 0.70 (e0), 0.72 (e1); e2, e3 stale → factor 0.1 after 2 (plateau patience 2);
    # e4 stale (wait 3) → stop (early-stopping patience 3); e3 does not beat 0.72 although it beats 0.71
    cb, trainer, module = BestValidation(plateau_factor=0.1, plateau_patience=2, early_stopping_patience=3), \
        _Trainer(), _Module()
    got = _validate(cb, trainer, module, [0.70, 0.72, 0.71, 0.715, 0.60])
    assert [round(f, 6) for f, _ in got] == [1.0, 1.0, 1.0, 0.1, 0.1]
    assert [s for _, s in got] == [False, False, False, False, True]
    assert (cb.best, cb.best_epoch, module.factors) == (pytest.approx(0.72), 1, [pytest.approx(0.1)])


def test_state_round_trip_reapplies_the_factor():
    cb, trainer, module = BestValidation(plateau_factor=0.5), _Trainer(), _Module()
    _validate(cb, trainer, module, [0.8, 0.7, 0.6])
    restored, again = BestValidation(plateau_factor=0.5), _Module()
    restored.load_state_dict(cb.state_dict())
    restored.on_fit_start(trainer, again)
    assert again.factors == [0.25] and restored.best == pytest.approx(0.8) and restored.stale == 0
