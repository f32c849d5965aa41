"""Where a benchmark writes, and how it starts its children: never into the checkout.

Every benchmark takes ``--work DIR``: the synthetic logs, stores, MLflow stores (and the artifacts MLflow puts under
the folder a run starts in), model folders and checkpoints go there, and its child processes run there. Without it,
a temporary folder holds them and is removed at the end (whatever the outcome). A checkout that is read-only, or
installed, then works, and the repository's disk never fills.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def work_folder(given: str | os.PathLike | None, prefix: str) -> Iterator[Path]:
    """``given`` (created, kept), else a fresh temporary folder named ``<prefix>*``, removed on the way out."""
    path = Path(given).resolve() if given else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def child_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the checkout added to ``PYTHONPATH`` — extended, never
    replaced (on a device machine it names the unpacked stack) — so children find the project from any folder."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        paths.append(str(ROOT))
    return {**env, "PYTHONPATH": os.pathsep.join(paths), **(extra or {})}
