"""Run a function on N CPU processes joined in a gloo process group (real torch.distributed)."""

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


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any,
           backend: str = "gloo") -> None:
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
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by ``backend`` (gloo, or
    :mod:`tests.device_only_backend`'s stand-in for NCCL); re-raise failures."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world_size, free_port(), fn, args, errors, backend), nprocs=world_size,
                           join=True, start_method="spawn")
    except Exception as e:
        details = []
        while not errors.empty():
            details.append(errors.get())
        raise AssertionError("\n".join(details) or str(e)) from e
