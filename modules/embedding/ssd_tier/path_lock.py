"""One run at a time on a rank's folder of ``topology.ssd.path``.

A run truncates its table files when it starts and deletes the sorted runs it finds, so a second run on
the same folder would zero the first one's mapped tables (which then reads zeros or dies with SIGBUS).
Each rank takes an exclusive ``flock`` on ``<path>/rank<r>/.lock`` before it touches a file there and holds
it for the life of its process; the kernel releases it when the process ends, however it ends, so a killed
run's files are cleaned up by the next run that takes the lock. The lock file names its holder (host, pid,
start time) for the refusal's message.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

_held: dict[Path, int] = {}  # folder → the descriptor this process locks it with


class SsdPathInUseError(RuntimeError):
    """Another process holds this rank's folder of ``topology.ssd.path``."""

    hint = "give each concurrent run its own topology.ssd.path (a sweep: e.g. topology.ssd.path=/nvme/ctr/${hydra:job.num})"


def lock_rank_folder(folder: str | os.PathLike) -> Path:
    """Take (or keep, if this process has it) the exclusive lock of ``folder``; raise
    :class:`SsdPathInUseError` naming the holder if another process has it."""
    folder = Path(folder).resolve()
    if folder in _held:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise SsdPathInUseError(f"topology.ssd.path: {folder} is in use by {holder}; a second run there would "
                                f"overwrite its table files") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
    _held[folder] = fd
    return folder
