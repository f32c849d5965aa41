"""``logger``: the MLflow tracking store and names, and what an unreachable server does (:mod:`pipeline.tracking.store`,
:mod:`pipeline.tracking.logger`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.model_folder.quantize import check_quantize


@dataclass
class LoggerConfig:
    """``logger``: the MLflow tracking store and names, and what an unreachable server does
    (:mod:`pipeline.tracking.logger`)."""

    tracking_uri: str = "sqlite:///mlflow.db"
    experiment_name: str = "ctr"
    run_name: Optional[str] = None
    on_unavailable: str = "fail"      # no server at the start: fail | local (a store in the output folder)
    connect_timeout_s: float = 5.0    # how long the start waits for the server's answer
    flush_timeout_s: float = 60.0     # at the end, how long queued calls may take to reach the server
    retry_max_s: float = 30.0         # longest wait between retries of a failed call
    heartbeat_s: float = 30.0         # the run's heartbeat tag; runs silent 5 beats: FAILED (pipeline/tracking/heartbeat.py)
    log_model: bool = True            # log the trained model (pyfunc, artifact `model`) at the end
    model_max_gb: float = 4.0         # larger tables: no MLflow model (score with ctr predict)
    register_model_as: Optional[str] = None  # also register it in the Model Registry under this name
    quantize: str = "none"            # the MLflow model's tables: none | int8 | int4 | fp16 (<output>/model keeps the rows as trained)
    model_signature: bool = True      # the MLflow model's signature from the dataset declaration (MLflow checks it)

    def __post_init__(self) -> None:
        if self.on_unavailable not in ("fail", "local"):
            raise ValueError(f"on_unavailable={self.on_unavailable!r}: expected 'fail' or 'local'")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s={self.heartbeat_s}: expected seconds > 0")
        check_quantize(self.quantize, "quantize")
