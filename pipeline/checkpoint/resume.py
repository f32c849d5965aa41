"""``trainer.resume``: which checkpoint a run continues, and the MLflow run it continues logging to."""

from __future__ import annotations

from pipeline.checkpoint.discovery import checked_checkpoint, newest_intact_checkpoint, read_rank0_state


def resume_checkpoint(resume: str | None, checkpoint_dir: str | None) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, its MLflow run id) for ``trainer.resume`` = null | auto | <path>;
    ``auto``: the newest intact checkpoint in ``trainer.checkpoint.dir``, or a fresh start without one."""
    if not resume:
        return None, None
    if resume == "auto":
        path = newest_intact_checkpoint(checkpoint_dir) if checkpoint_dir else None
        if path is None:
            return None, None
    else:
        path = checked_checkpoint(resume)
    state = read_rank0_state(path)
    return str(path), (state.get("pipeline") or {}).get("mlflow_run_id")
