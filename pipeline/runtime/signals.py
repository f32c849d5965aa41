"""Graceful preemption: a signal ends the run at a step boundary, with a checkpoint and a non-zero status.

SLURM, Kubernetes and spot instances send SIGTERM (SLURM's early warning: ``--signal=USR1@90``)
some time before SIGKILL. While a run is under :class:`SignalGuard`, each signal of
``trainer.preemption.signals`` is handled the same way:

1. the handler only records the signal and its time (nothing else runs inside a signal handler);
2. after every training step (:class:`pipeline.training.callbacks.stop_on_signal.StopOnSignal`) the ranks agree on whether any of them got one (an all-reduce of one
   number), so all stop after the same step;
3. the run writes a checkpoint when ``trainer.checkpoint.dir`` is set (``trainer.resume=auto`` then
   continues exactly), skips the test, marks the MLflow run KILLED and flushes its logging;
4. the process exits with status 128 + signal number — or, under SLURM with
   ``trainer.preemption.requeue``, requeues the job (``scontrol requeue``) and exits the same way.

A signal during validation, test or model writing is acted on when that work ends. If the run has not
ended ``grace_s`` seconds after the signal, a watchdog ends it at once with the same status (a
checkpoint being written then is left as a temporary folder; the previous one stays intact).

Lightning's own SIGTERM handling (a ``SIGTERMException``, a ``SystemExit`` with status 0, and a
broadcast from inside the signal handler) is replaced while training runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List

import torch
import torch.distributed as dist

from modules.host_collectives import host_group
from pipeline.runtime.launch import group_rank, group_size


@dataclass
class PreemptionConfig:
    """``trainer.preemption``."""

    signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    grace_s: float = 60.0      # after a signal, the run ends within this many seconds whatever it is doing
    requeue: bool = True       # under SLURM (SLURM_JOB_ID set): requeue the job before exiting

    def __post_init__(self) -> None:
        bad = [s for s in self.signals if not isinstance(getattr(signal, str(s), None), signal.Signals)]
        if bad:
            raise ValueError(f"signals: {bad} are not signal names (e.g. SIGTERM, SIGINT, SIGUSR1)")
        if self.grace_s <= 0:
            raise ValueError(f"grace_s={self.grace_s}: expected seconds > 0")


class SignalGuard:
    """Records the first preemption signal; a context manager that installs the handlers and restores
    the previous ones on exit."""

    def __init__(self, cfg: PreemptionConfig) -> None:
        self.cfg = cfg
        self.signals = [getattr(signal, s) for s in cfg.signals]
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            print(f"Received {signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(self.exit_status)
        self.signum, self.received_at = signum, time.monotonic()
        print(f"Received {signal.Signals(signum).name}: stopping after the current step, with a checkpoint where "
              f"trainer.checkpoint.dir is set (at most trainer.preemption.grace_s={self.cfg.grace_s:g} s; "
              f"the same signal again: at once)", file=sys.stderr, flush=True)
        threading.Thread(target=self._watchdog, daemon=True, name="preemption-watchdog").start()

    def _watchdog(self) -> None:
        time.sleep(self.cfg.grace_s)
        print(f"Preemption: not finished {self.cfg.grace_s:g} s after the signal; exiting now", file=sys.stderr,
              flush=True)
        os._exit(self.exit_status)

    def install(self) -> None:
        """(Re-)install the handlers: Lightning installs its own SIGTERM handler when training starts."""
        for s in self.signals:
            previous = signal.signal(s, self.handle)
            self._previous.setdefault(s, previous)

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    @property
    def exit_status(self) -> int:
        return 128 + (self.signum or 0)

    def seconds_since_signal(self) -> float:
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0

    def agreed(self) -> bool:
        """Whether any rank got a signal (collective: every rank calls it after the same step)."""
        flag = torch.tensor([0 if self.signum is None else 1], device="cpu")
        if group_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
        return bool(flag.item())

    def requeue(self) -> bool:
        """Under SLURM with ``requeue``: ``scontrol requeue $SLURM_JOB_ID``; whether it was asked."""
        job = os.environ.get("SLURM_JOB_ID")
        if not (self.cfg.requeue and job):
            return False
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        print(f"SLURM job {job}: requeue {'asked' if done.returncode == 0 else 'failed: ' + done.stderr.strip()}",
              file=sys.stderr, flush=True)
        return done.returncode == 0


class Preempted(SystemExit):
    """The run stopped on a signal; ``code`` is the exit status (128 + signal). Says so on rank 0 (after a
    requeue under SLURM)."""

    def __init__(self, guard: SignalGuard, step: int, checkpoint_dir: str | None) -> None:
        super().__init__(guard.exit_status)
        self.guard = guard
        if group_rank() == 0:
            requeued = guard.requeue()
            where = (f"checkpoint in {checkpoint_dir} (continue: trainer.resume=auto)" if checkpoint_dir
                     else "no checkpoint (trainer.checkpoint.dir is not set)")
            print(f"Stopped by {signal.Signals(guard.signum).name} after step {step}, "
                  f"{guard.seconds_since_signal():.1f} s after the signal; {where}; MLflow run marked KILLED; "
                  f"exit status {guard.exit_status}{' (SLURM job requeued)' if requeued else ''}",
                  file=sys.stderr, flush=True)
