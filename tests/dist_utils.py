"""Run a function on N CPU processes joined in a gloo process group (real torch.distributed).

The ranks are forked from multiprocessing's fork server, which imported the stack (torch, TorchRec, the
pipeline) once per test worker: a spawned rank, a fresh interpreter, spends ~5 s of CPU importing it again. Each rank
still gets the caller's environment and working folder as they are at the call (the server's are those of its start).
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.runtime.launch import free_port
from pipeline.runtime.process_exit import exit_now, leave_process_group
from tests import device_only_backend


# imported once by the fork server (its first use in a test worker); the ranks are forked from it
PRELOAD = ["tests.conftest", "tests.dist_utils", "torchrec.distributed.model_parallel", "modules.models",
           "modules.sharding.planner", "pipeline.training.task", "mlflow.tracking"]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any,
           backend: str, env: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if backend == device_only_backend.NAME:
        device_only_backend.register()
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        leave_process_group()
    exit_now(0)  # every check passed; no interpreter teardown (see pipeline.runtime.process_exit)


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes joined by ``backend`` (gloo, or
    :mod:`tests.device_only_backend`'s stand-in for NCCL); re-raise failures."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world_size, free_port(), fn, args, errors, backend, dict(os.environ),
                                         os.getcwd()), nprocs=world_size, join=True, start_method="forkserver")
    except Exception as e:
        details = []
        while not errors.empty():
            details.append(errors.get())
        raise AssertionError("\n".join(details) or str(e)) from e
