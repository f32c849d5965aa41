"""What a finished run reports: ``result.json`` in its output folder, and the ``RESULT`` line for people.

Tests and benchmarks read ``result.json`` through :func:`read_result` instead of parsing the line.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

RESULT_FILE = "result.json"


@dataclass(frozen=True)
class RunResult:
    test_auc: float
    test_logloss: float
    samples_per_s: float            # training samples per second over all ranks, validation excluded
    comm_bytes_per_step: float      # bytes of collectives one rank issued per training step
    mlflow_run_id: str | None
    output_dir: str
    best_val_auc: float | None = None   # what a sweep optimises
    samples_per_s_after_warmup: float | None = None  # after this process's first steps (their time: warmup_s)
    warmup_s: float | None = None
    table_bytes: int | None = None         # the embedding tables with their optimizer state, as planned (one copy)
    table_weight_bytes: int | None = None  # … their weights alone (model.table_precision: 2 or 4 bytes a value)

    def line(self) -> str:
        return (f"RESULT test_auc={self.test_auc:.6f} test_logloss={self.test_logloss:.6f} "
                f"samples_per_s={self.samples_per_s:.1f} comm_bytes_per_step={self.comm_bytes_per_step:.0f} "
                f"mlflow_run_id={self.mlflow_run_id}")

    def write(self) -> Path:
        """``<output_dir>/result.json``, written under a temporary name and renamed."""
        path = Path(self.output_dir) / RESULT_FILE
        tmp = path.with_name(f".{RESULT_FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def read_result(output_dir: str | os.PathLike) -> RunResult:
    """The result a run wrote into ``output_dir`` (its Hydra output folder)."""
    path = Path(output_dir) / RESULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no result (the run did not finish, or ran elsewhere)")
    return RunResult(**json.loads(path.read_text()))
