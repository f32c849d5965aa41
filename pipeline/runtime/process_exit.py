"""Leave a process that used a gloo process group without interpreter teardown.

A gloo process group runs its collectives on worker threads (``pt_gloo_runloop``). Right after a
collective completes, the worker still holds the finished work item; dropping it releases the
work's tensors, which needs the GIL when Python sees them. If the main thread has reached
interpreter finalization by then, CPython ends the worker with ``pthread_exit``, whose forced
unwind through a ``noexcept`` destructor calls ``std::terminate``: the process dies with SIGABRT
("terminate called without an active exception") after all its work is done. Caught here with a
``std::set_terminate`` backtrace: ``ProcessGroupGloo::runLoop`` → ``~AsyncAllgatherWork`` →
``TensorImpl::decref_pyobject`` → ``PyEval_AcquireThread`` → ``pthread_exit`` while the main thread
was in ``Py_FinalizeEx``; see also pytorch/pytorch#179291.

``destroy_process_group`` alone does not close the window: it only joins the worker threads when
the last reference to the group goes, and libraries keep references (``torch.distributed.nn``
captures the default group as a default argument when imported after ``init_process_group``).
So a finished run destroys its group, flushes its output and leaves with ``os._exit``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

from modules import host_collectives


def leave_process_group() -> None:
    """Destroy the process group (and all subgroups) if one is initialized."""
    if dist.is_available() and dist.is_initialized():
        host_collectives.forget()
        dist.destroy_process_group()


def exit_now(code: int = 0) -> NoReturn:
    """Flush logs and standard streams, then end the process with ``code`` and no interpreter teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def stop_worker_pools() -> None:
    """Stop the worker processes a joblib sweep left idle (``hydra/launcher=joblib``): they hold the
    command's output open and would otherwise linger for loky's idle timeout (5 minutes)."""
    if "joblib.externals.loky" in sys.modules:
        from joblib.externals.loky import get_reusable_executor

        get_reusable_executor().shutdown(wait=True, kill_workers=True)
