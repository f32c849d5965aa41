"""How the commands end on a user error: one clean line naming the cause, a hint, exit status 2.

User errors are the classes of :mod:`pipeline.runtime.errors` (each with its hint), tables that cannot
be placed (:class:`modules.sharding.placement.PlacementError`), an id outside its table
(:class:`modules.embedding.lookup_inputs.IdOutOfRangeError`), an ssd path another run holds
(:class:`modules.embedding.ssd_tier.path_lock.SsdPathInUseError`) and a missing file. Anything else is a bug and
keeps its traceback; ``HYDRA_FULL_ERROR=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

from omegaconf import DictConfig, OmegaConf

from modules.embedding.lookup_inputs import IdOutOfRangeError
from modules.embedding.ssd_tier.path_lock import SsdPathInUseError
from modules.sharding.placement import PlacementError
from pipeline.config import to_typed
from pipeline.runtime.errors import UserError

T = TypeVar("T")
EXIT_USER_ERROR = 2
USER_ERRORS = (UserError, PlacementError, IdOutOfRangeError, SsdPathInUseError, FileNotFoundError)


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
    except USER_ERRORS as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        hint = "check the path" if isinstance(e, FileNotFoundError) else e.hint
        print(f"Error ({type(e).__name__}): {user_error_message(e)}" + (f"\nHint: {hint}" if hint else ""),
              file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
