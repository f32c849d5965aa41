"""How the commands end on a user error: one clean line naming the cause, a hint, exit status 2.

User errors are a bad config value, a bad input file, a checkpoint that does not fit or is damaged,
tables that cannot be placed, a full disk, an unreachable tracking server, a missing file. Anything
else is a bug and keeps its traceback; ``HYDRA_FULL_ERROR=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

from omegaconf import DictConfig, OmegaConf

from modules.placement import PlacementError
from pipeline.checkpoint.checkpointing import CheckpointMismatchError, CorruptCheckpointError
from pipeline.config import ConfigError, to_typed
from pipeline.data.reader import BadInputError
from pipeline.runtime.errors import DiskFullError, TrackingUnavailableError
from pipeline.serving.model_folder import BundleError

T = TypeVar("T")
EXIT_USER_ERROR = 2
HINTS: dict[type, str] = {
    ConfigError: "check that key on the command line or in conf/ (`--cfg job` prints the composed config)",
    BadInputError: "fix the file, or drop and count such rows with data.preprocess.bad_rows=skip",
    CheckpointMismatchError: "resume with the settings the checkpoint was written with, or start a fresh "
                             "trainer.checkpoint.dir",
    CorruptCheckpointError: "resume from an earlier checkpoint (trainer.resume=auto skips damaged ones)",
    PlacementError: "see the plan with ctr plan",
    DiskFullError: "free space there, or point that path elsewhere",
    TrackingUnavailableError: "start the server, or log to a local store with logger.on_unavailable=local",
    BundleError: "export the model again (ctr export), or use the run's <output>/model folder",
    FileNotFoundError: "check the path",
}


def command_args(cfg: DictConfig, schema: type[T]) -> T:
    """A small command's composed config (``conf/<command>.yaml`` plus overrides) as its typed
    dataclass; a missing or mistyped key ends the process with a message naming it."""
    return exit_on_user_error(lambda: to_typed(OmegaConf.merge(OmegaConf.structured(schema), cfg)))


def user_error_message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror is not None:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return " ".join(str(e).split())


def exit_on_user_error(fn: Callable[[], T]) -> T:
    """``fn()``; a user error ends the process with its message on one line, a hint, and status 2."""
    try:
        return fn()
    except tuple(HINTS) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        hint = next(h for cls, h in HINTS.items() if isinstance(e, cls))
        print(f"Error ({type(e).__name__}): {user_error_message(e)}\nHint: {hint}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
