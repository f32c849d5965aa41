"""Old model versions leave the serve directory: the current and the previous published version stay
(a rollback is a publish away), everything else goes once no worker uses it.

What a serve directory holds per version: ``mlflow-<hash>/`` (a downloaded MLflow model),
``checkpoint-<hash>/`` (a checkpoint exported to a model folder) and ``fused/<hash>/`` (the buffers of
the fused or quantized tables that the workers map). Each worker names the versions it serves or is
loading in ``workers/<pid>.json`` (:func:`record_use`, temporary name then rename); the process that
publishes calls :func:`prune` after each publish and every poll. A worker that died leaves a file whose
pid is gone: the file is removed and its versions count as unused. A worker names a ``fused/`` folder
(and touches it) before it writes or maps it, and :func:`prune` deletes only folders last touched before
it read the workers' files; a worker that still loses that race (the folder deleted between the two)
logs the failed load and keeps serving its version. Model folders outside the serve directory
(``model=<folder>``, ``serve.watch=<folder>``) are the user's and never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

WORKERS = "workers"
FUSED = "fused"
VERSION_PREFIXES = ("mlflow-", "checkpoint-")


def record_use(workdir: Path, folders: list[str], fused: list[Path], serving: str | None) -> None:
    """This worker uses (serves or is loading) the model ``folders`` and the ``fused`` buffer folders, and
    answers with ``serving`` (None: still loading its first)."""
    folder = workdir / WORKERS
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"folders": folders, "fused": [p.name for p in fused], "serving": serving}))
    os.replace(tmp, folder / f"{os.getpid()}.json")
    for path in fused:
        if path.is_dir():
            os.utime(path)


def forget_use(workdir: Path) -> None:
    (workdir / WORKERS / f"{os.getpid()}.json").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process of that pid: alive
        return True
    return True


def in_use(workdir: Path) -> tuple[set[str], set[str]]:
    """The model folders and the names of the fused folders the live workers use (dead workers' files removed)."""
    folders: set[str] = set()
    fused: set[str] = set()
    for path in (workdir / WORKERS).glob("*.json"):
        try:
            pid = int(path.stem)
            use = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if not _alive(pid):
            path.unlink(missing_ok=True)
            continue
        folders.update(use["folders"])
        fused.update(use["fused"])
    return folders, fused


def prune(workdir: Path, keep: list[str]) -> list[Path]:
    """Delete the version folders of ``workdir`` that are neither in ``keep`` (model folders: the current
    and the previous version) nor used by a live worker; returns what was deleted."""
    read_at = time.time()
    used, used_fused = in_use(workdir)
    kept = {Path(f).resolve() for f in (*keep, *used)}
    deleted = []
    for top in workdir.iterdir():
        if top.name.startswith(VERSION_PREFIXES) and top.is_dir():
            top = top.resolve()
            if not any(k == top or top in k.parents for k in kept):
                deleted.append(top)
    for folder in (workdir / FUSED).glob("*"):
        if folder.is_dir() and folder.name not in used_fused and folder.stat().st_mtime < read_at - 1:
            deleted.append(folder)
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted
