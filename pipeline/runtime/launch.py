"""Where a process stands in a launch — its world from torchrun's (or SLURM's) variables before the
process group exists, its rank in the group after — and a free local port for starting a rendezvous
or a server on 127.0.0.1 (tests, benchmarks). The one place that answers "which rank am I"."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def world_from_env() -> tuple[int, int]:
    """(world size, ranks per node) as torchrun sets them — or SLURM, for a job whose tasks it started
    itself (``hydra/launcher=slurm``); (1, 1) for a plain process."""
    if "WORLD_SIZE" not in os.environ and "SLURM_NTASKS" in os.environ:
        world = int(os.environ["SLURM_NTASKS"])
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0].split(",")[0]
        return world, int(per_node)
    world = int(os.environ.get("WORLD_SIZE", 1))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def group_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def group_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank of the default process group (nothing without one)."""
    if dist.is_initialized():
        dist.barrier()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
