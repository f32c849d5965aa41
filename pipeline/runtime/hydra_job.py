"""The Hydra job this process runs, when it runs under ``@hydra.main`` (tests and the daily driver
compose configs themselves: then there is none): its output folder, whether it is one job of a
multirun, how many threads its launcher leaves it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig


def hydra_config() -> DictConfig | None:
    """Hydra's own config of this job (None when not under ``@hydra.main``)."""
    return HydraConfig.get() if HydraConfig.initialized() else None


def in_sweep() -> bool:
    hydra_cfg = hydra_config()
    return hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN


def output_dir() -> Path:
    """The job's output folder (a fresh temporary one outside Hydra)."""
    hydra_cfg = hydra_config()
    return Path(hydra_cfg.runtime.output_dir) if hydra_cfg else Path(tempfile.mkdtemp(prefix="ctr-run-"))


def threads_per_job() -> int | None:
    """Under the joblib launcher, each of its ``n_jobs`` parallel jobs gets an equal share of the cores."""
    hydra_cfg = hydra_config()
    if hydra_cfg is None or "joblib" not in str(hydra_cfg.launcher.get("_target_", "")):
        return None
    cores = os.cpu_count() or 1
    jobs = int(hydra_cfg.launcher.n_jobs)
    return max(1, cores // (jobs if jobs > 0 else cores))
