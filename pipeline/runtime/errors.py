"""User errors: every error a user can fix, each with its hint.

A bad config value, a bad input file, a checkpoint that does not fit or is damaged, a model folder
that cannot be read, a full disk, an unreachable tracking server. The commands report each as one
clean line, its ``hint`` and exit status 2 (:func:`pipeline.commands.args.exit_on_user_error`);
anything else is a bug and keeps its traceback. Tables that cannot be placed raise
:class:`modules.sharding.placement.PlacementError`, which carries a hint of its own (``modules`` does not
import the pipeline).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class UserError(Exception):
    """An error the user can fix; ``hint`` says how (each subclass names its own)."""

    hint = ""

    def __init_subclass__(cls, hint: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if hint:  # else the parent's
            cls.hint = hint


class ConfigError(UserError, ValueError,
                  hint="check that key on the command line or in conf/ (`--cfg job` prints the composed config)"):
    """A config value that cannot work; the message starts with the full key."""


class BadInputError(UserError, ValueError,
                    hint="fix the file; when training, data.preprocess.bad_rows=skip drops and counts such rows"):
    """A raw file that does not match its declared layout."""


class MissingColumnsError(BadInputError, hint="give the file (or request) the columns its dataset's declaration reads "
                                              "(docs/datasets.md); skipping rows cannot help"):
    """A file (or a request) laid out otherwise than its declaration reads: columns missing, another count."""


class CheckpointMismatchError(UserError, ValueError,
                              hint="resume with the settings the checkpoint was written with, or start a fresh "
                                   "trainer.checkpoint.dir"):
    """A checkpoint written for another model, table layout or world size."""


class CorruptCheckpointError(UserError, ValueError,
                             hint="resume from an earlier checkpoint (trainer.resume=auto skips damaged ones)"):
    """A checkpoint whose files no longer match its manifest (truncated, changed or missing)."""


class BundleError(UserError, ValueError,
                  hint="export the model again (ctr export), or use the run's <output>/model folder"):
    """A model folder (or checkpoint to score) that cannot be read, or input it cannot score."""


class DiskFullError(UserError, OSError, hint="free space there, or point that path elsewhere"):
    """Writing ran out of space (or hit a file-size limit); names the path and the bytes needed."""


class TrackingUnavailableError(UserError, RuntimeError,
                               hint="start the server, or log to a local store with logger.on_unavailable=local"):
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
