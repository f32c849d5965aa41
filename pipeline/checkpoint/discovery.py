"""Which checkpoint: the finished ones in a folder, the newest intact one (damaged ones skipped with a
warning), and a path checked before use — a folder of checkpoints means its newest intact one."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pipeline.checkpoint.manifest import verify_checkpoint
from pipeline.checkpoint.skeleton import STATE_FILE, without_tensors
from pipeline.runtime.errors import CorruptCheckpointError

log = logging.getLogger(__name__)


def complete_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories in ``folder``, oldest first (by training step, then time)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and ".tmp-" not in p.name and (p / ".metadata").is_file()
             and (p / STATE_FILE.format(rank=0)).is_file()]

    def step(p: Path) -> tuple[int, float]:
        state = json.loads((p / STATE_FILE.format(rank=0)).read_text())
        return int(dict(state["__dict__"]).get("global_step", 0)) if "__dict__" in state else 0, p.stat().st_mtime

    return sorted(found, key=step)


def newest_intact_checkpoint(folder: str | os.PathLike, candidates: list[Path] | None = None) -> Path | None:
    """The newest complete checkpoint in ``folder`` (or of its ``candidates``, already listed) that matches
    its manifest; damaged newer ones are skipped with a warning naming them."""
    for path in reversed(complete_checkpoints(folder) if candidates is None else candidates):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        log.warning("Skipping damaged checkpoint %s: %s", path, "; ".join(problems))
    return None


def checked_checkpoint(path: str | os.PathLike, verify: bool = True) -> Path:
    """``path`` if it is an intact checkpoint directory; a folder of checkpoints (a run's
    ``trainer.checkpoint.dir``) means its newest intact one. A damaged one: :class:`CorruptCheckpointError`.
    ``verify=False``: no file is hashed against the manifest (a folder: its newest complete checkpoint) —
    for reading a checkpoint's description, never its tensors."""
    path = Path(path)
    if not (path / STATE_FILE.format(rank=0)).is_file():
        candidates = complete_checkpoints(path)
        if candidates and not verify:
            return candidates[-1]
        if candidates:
            newest = newest_intact_checkpoint(path, candidates)
            if newest is None:
                raise CorruptCheckpointError(f"{path}: every checkpoint in this folder is damaged")
            return newest
        raise FileNotFoundError(f"{path} is neither a checkpoint directory (no {STATE_FILE.format(rank=0)}) nor a "
                                f"folder of checkpoints (trainer.checkpoint.dir)")
    problems = verify_checkpoint(path) if verify else []
    if problems:
        raise CorruptCheckpointError(f"{path} is damaged: " + "; ".join(problems))
    return path


def read_rank0_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON (non-tensor) part of rank 0's checkpoint state, tensors left as None."""
    return without_tensors(json.loads((Path(path) / STATE_FILE.format(rank=0)).read_text()))
