"""Where a process stands in a launch: its world from torchrun's variables, and a free local port for
starting a rendezvous or a server on 127.0.0.1 (tests, benchmarks)."""

from __future__ import annotations

import os
import socket


def world_from_env() -> tuple[int, int]:
    """(world size, ranks per node) as torchrun sets them; (1, 1) for a plain process."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def global_rank() -> int:
    return int(os.environ.get("RANK", 0))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
