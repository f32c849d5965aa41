"""One run at a time on a rank's folder of ``topology.ssd.path``.

A run truncates its table files when it starts and deletes the sorted runs it finds, so a second run on
the same folder would zero the first one's mapped tables (which then reads zeros or dies with SIGBUS).
Each rank takes an exclusive ``flock`` on ``<path>/rank<r>/.lock`` before it touches a file there and holds
it for the life of its process; the kernel releases it when the process ends, however it ends. The lock
file names its holder (host, pid, start time) for the refusal's message.

Nothing is left behind: when a run ends (finished, failed, preempted: :func:`release_rank_folders`, called
by :func:`pipeline.training.run.train`; or at the process's normal exit), its folders' files are deleted —
every row lives in the checkpoints and the model folder by then. A run that was killed leaves its files;
the next run that takes the lock deletes them first (nobody holds them: they are stale), whatever tables
they were for.
"""

from __future__ import annotations

import atexit
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
    _remove_files(folder)  # a killed run's: stale
    if not _held:
        atexit.unregister(release_rank_folders)  # once, however often the folders are taken again
        atexit.register(release_rank_folders)
    _held[folder] = fd
    return folder


def _remove_files(folder: Path) -> None:
    """Every file of a locked rank folder but its lock."""
    for path in folder.iterdir():
        if path.name != ".lock" and path.is_file():
            path.unlink(missing_ok=True)


def release_rank_folders() -> None:
    """The end of a run: the files of the folders this process holds deleted, then the locks released."""
    for folder, fd in list(_held.items()):
        _remove_files(folder)
        os.close(fd)
    _held.clear()
