"""What third-party libraries print on every run that is not the user's business, silenced in one place
(:func:`quiet_libraries`, called when any ``ctr`` command starts). Each entry names its source; warnings
of this project and any other warning of these libraries still show.

* torch's pytree: ``isinstance(treespec, LeafSpec)`` is deprecated — a FutureWarning raised inside
  Lightning and TorchRec, at every run.
* torch.fx: "is_fx_tracing will return true for both fx.symbolic_trace and torch.export" — logged by
  TorchRec's modules calling ``is_fx_tracing()``, once per process.
* torch.distributed: "Please use DTensor instead and we are deprecating ShardedTensor" — TorchRec's
  sharded state dicts are ShardedTensors; raised at export and checkpoint.
* MLflow's "Downloading artifacts" progress bars — when a model is read back (logging it, serving it).
"""

from __future__ import annotations

import logging
import os
import warnings

WARNINGS = (  # (message regex, category)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)
LOGGED = {"torch.fx._symbolic_trace": "is_fx_tracing will return true for both fx.symbolic_trace"}


class _Without(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_libraries() -> None:
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for logger, text in LOGGED.items():
        logging.getLogger(logger).addFilter(_Without(text))
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
