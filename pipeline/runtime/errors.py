"""Errors of the machine a run is on: a full disk, an unreachable tracking server. Like the other user
errors (``ConfigError``, ``BadInputError``, ``CheckpointMismatchError``, ...) the command line reports
them as one clean line and exit status 2 (:mod:`pipeline.commands.args`)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class DiskFullError(OSError):
    """Writing ran out of space (or hit a file-size limit); names the path and the bytes needed."""


class TrackingUnavailableError(RuntimeError):
    """The MLflow tracking server did not answer at the start of a run."""


def _size(n: int | None) -> str:
    return f"about {n / 2**20:,.1f} MiB ({n:,} bytes)" if n else "more space"


def _no_space(err: BaseException | None, depth: int = 0) -> OSError | None:
    """The no-space ``OSError`` in ``err``'s chain (causes, contexts, DCP's per-rank failures), if any."""
    if err is None or depth > 8:
        return None
    if isinstance(err, OSError) and err.errno in NO_SPACE:
        return err
    nested = [err.__cause__, err.__context__] + [v for v in getattr(err, "failures", {}).values()
                                                 if isinstance(v, BaseException)]
    return next((found for e in nested if (found := _no_space(e, depth + 1)) is not None), None)


def disk_full(err: BaseException, path: os.PathLike | str, needed_bytes: int | None) -> DiskFullError | None:
    """The :class:`DiskFullError` for ``err`` if a no-space error caused it, else None."""
    cause = _no_space(err)
    if cause is None:
        return None
    return DiskFullError(cause.errno, f"{path}: no space left while writing ({os.strerror(cause.errno)}); it needs "
                                      f"{_size(needed_bytes)}; nothing was left half-written")


def ensure_space(path: os.PathLike | str, needed_bytes: int) -> None:
    """Raise :class:`DiskFullError` before writing ``needed_bytes`` under ``path`` if its filesystem has less free."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed_bytes > free:
        raise DiskFullError(errno.ENOSPC, f"{path}: not enough space to write it: it needs {_size(needed_bytes)}, "
                                          f"the filesystem has {free / 2**20:,.1f} MiB free; nothing was written")
