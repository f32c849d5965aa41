"""What third-party libraries print on every run that is not the user's business, silenced in one place
(:func:`quiet_libraries`, called when any ``ctr`` command starts). Each entry names its source; warnings
of this project and any other warning of these libraries still show.

* torch's pytree: ``isinstance(treespec, LeafSpec)`` is deprecated — a FutureWarning raised inside
  Lightning and TorchRec, at every run.
* torch.fx: "is_fx_tracing will return true for both fx.symbolic_trace and torch.export" — logged by
  TorchRec's modules calling ``is_fx_tracing()``, once per process.
* torch.distributed: "Please use DTensor instead and we are deprecating ShardedTensor" — TorchRec's
  sharded state dicts are ShardedTensors; raised at export and checkpoint.
* Lightning: "💡 Tip: ... try installing [litlogger]" — an advert, at every Trainer.
* MLflow: "The version of CloudPickle used to save the model could not be found in the MLmodel configuration" —
  logged when it loads a pyfunc model saved from code (ours: no pickle) to check the input example.
* MLflow's "Downloading artifacts" progress bars — when a model is read back (logging it, serving it).

Progress bars of the project's own (tqdm) show on a terminal only, never in a log file.
"""

from __future__ import annotations

import logging
import os
import warnings

WARNINGS = (  # (message regex, category)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)
LOGGED = {  # logger → the messages of it silenced
    "torch.fx._symbolic_trace": ("is_fx_tracing will return true for both fx.symbolic_trace",),
    "lightning.pytorch.utilities.rank_zero": ("try installing [litlogger]",),
    "mlflow.pyfunc": ("The version of CloudPickle used to save the model could not be found",),
}


class _Without(logging.Filter):
    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def quiet_libraries() -> None:
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for logger, texts in LOGGED.items():
        logging.getLogger(logger).addFilter(_Without(texts))
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
