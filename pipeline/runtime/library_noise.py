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
* MLflow: "Passing a Python object as `python_model` causes it to be serialized using CloudPickle ..." at model
  logging (our model object holds no code of the user's), and "The version of CloudPickle used to save the model
  could not be found" when it loads one back to check the input example.
* TorchRec's DMP with several ranks: "`broadcast_buffers` is deprecated" (a FutureWarning from inside TorchRec);
  torchmetrics 1.0.3 syncing across ranks: "Using a non-tuple sequence for multidimensional indexing is deprecated".
* torchrec 1.6.1 (the torch 2.11 stack) at import, on the root logger: "_fbgemm_torch_compat_table has no entry for
  1.6.0 of FBGEMM" — the pair the extra ``gpu-torch211`` pins.
* TorchRec's planner: a FutureWarning and a logged warning that ``HeuristicalStorageReservation`` over-estimates
  dense tensors in dry runs — at every plan (the project sizes memory itself: :mod:`modules.sharding.placement`).
* MLflow's "Downloading artifacts" progress bars — when a model is read back (logging it, serving it).
* Lightning's start-up lines that say nothing about this run: "TPU available: False", "Initializing distributed:
  GLOBAL_RANK ...", the "distributed_backend=gloo / All distributed processes registered" banner, "Loading
  `train_dataloader` to estimate number of stepping batches", "`Trainer(val_check_interval=1.0)` was configured so
  validation will run at the end of the training epoch", "Using bfloat16 Automatic Mixed Precision (AMP)" (the run
  prints its precision and why itself: pipeline/training/run.py), and its MLflow logger's "Experiment with name ... not
  found. Creating it." (a first run's normal case, as a warning). "GPU available: ..." stays: it says where the
  run trains.
* Lightning at every checkpoint: "`weights_only` was not set, defaulting to `False`" (the project's checkpoint IO reads
  with ``weights_only`` and its own metadata reader whatever Lightning passes: :mod:`pipeline.checkpoint.dcp_io`), and
  on a mid-epoch resume "your dataloader is not resumable" (the loader resumes at the batch training reached,
  :meth:`pipeline.data.batches.BatchLoader.resume_at`; the kill-and-resume tests end at the uninterrupted run's bits).
* MLflow's "Creating initial MLflow database tables..." / "Updating database tables" (a new local store) and
  "Validating input example against model signature" (at model logging).

Not filtered, because it is not a Python line: c10d's "The hostname of the client socket cannot be retrieved" is
printed in C++ (by torchrun's agent too, a process of torch's) when a peer's address has no name; give the nodes'
addresses names (``/etc/hosts`` or reverse DNS), as ``benchmarks/netns_cluster.py`` does for its namespaces.

Progress bars of the project's own (tqdm) show on a terminal only, never in a log file. Lightning's own console
handler on its ``lightning`` logger prints every line a second time beside the run's (Hydra's) handlers:
:func:`one_copy_of_each_line` removes it once those handlers exist.
"""

from __future__ import annotations

import logging
import os
import warnings

WARNINGS = (  # (message regex, category)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    (r"HeuristicalStorageReservation is known to cause issues", FutureWarning),
    (r"`broadcast_buffers` is deprecated", FutureWarning),
    (r"Using a non-tuple sequence for multidimensional indexing is deprecated", UserWarning),
    (r"`_get_pg_default_device` will be deprecated", UserWarning),  # torchrec 1.6.1 on torch 2.11
    (r"Multiple backends are registered with this ProcessGroup", UserWarning),  # the same call, there
    (r"You.re resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
     UserWarning),  # Lightning on a mid-epoch resume: the project resumes it
)
LOGGED = {  # logger → the messages of it silenced
    "torch.fx._symbolic_trace": ("is_fx_tracing will return true for both fx.symbolic_trace",),
    "lightning.pytorch.utilities.rank_zero": ("try installing [litlogger]", "TPU available:",
                                               "All distributed processes registered",
                                               "to estimate number of stepping batches",
                                               "so validation will run at the end of the training epoch",
                                               "Automatic Mixed Precision (AMP)"),
    "lightning.fabric.utilities.distributed": ("Initializing distributed: GLOBAL_RANK",),
    "lightning.pytorch.loggers.mlflow": ("not found. Creating it.",),
    "lightning.pytorch.trainer.connectors.checkpoint_connector": ("`weights_only` was not set",),
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
    "mlflow.pyfunc": ("causes it to be serialized using CloudPickle",
                      "The version of CloudPickle used to save the model could not be found",
                      "Validating input example against model signature"),
    "torchrec.distributed.planner.storage_reservations": ("There is a known issue with TorchRec's dense tensor size",),
    "": ("_fbgemm_torch_compat_table has no entry",),  # the root logger: torchrec 1.6.1 on fbgemm-gpu 1.6.0
}


class _Without(logging.Filter):
    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def one_copy_of_each_line() -> None:
    """Drop Lightning's own console handler where the root logger has handlers of its own (a ``ctr`` command's,
    set up by Hydra: they print Lightning's lines, and write them to the run's log file)."""
    if not logging.getLogger().handlers:
        return
    lightning = logging.getLogger("lightning")
    for handler in list(lightning.handlers):
        if type(handler) is logging.StreamHandler:
            lightning.removeHandler(handler)


def quiet_libraries() -> None:
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for logger, texts in LOGGED.items():
        logging.getLogger(logger).addFilter(_Without(texts))
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
