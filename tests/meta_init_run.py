"""``python -m tests.meta_init_run <ctr train overrides>``: ``ctr train`` with Lightning's init context entered as
``torch.device("meta")`` instead of the root device.

On a GPU Lightning runs ``configure_model`` under ``torch.device("cuda:N")`` (``Strategy.tensor_init_context``), so a
host-side structure made there without a device lands in GPU memory, and a CPU-only step on it (numpy, a CPU tensor
beside it) fails. Here such a structure lands on ``meta`` instead, where it holds no data: the run fails, or
``tests.meta_checks.HostStructures`` (a callback the caller adds) finds it. CI has no GPU; this is its stand-in.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pipeline.training.strategy import TorchRecStrategy


@contextmanager
def _meta_init_context(self, empty_init=None):
    with torch.device("meta"):  # where Lightning enters ``self.root_device``
        yield


if __name__ == "__main__":
    TorchRecStrategy.tensor_init_context = _meta_init_context
    from pipeline.commands.train import cli
    cli()
