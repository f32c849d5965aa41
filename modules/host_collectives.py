"""One rule for the collectives the project itself makes: host tensors go over gloo, device tensors over the
process group the caller names.

What decides a step — a preemption flag, a non-finite flag, clipping counts, a timing, the addresses of the peers —
lives on the host, where it is read. Such tensors are made on the CPU (``device="cpu"``, never the default device:
Lightning builds the model under ``torch.device(root_device)``) and reduced over :func:`host_group`:

    host_group(g) = g                            if g's backend is gloo (every CPU run)
                  = the gloo twin of the world   if g is the world (None) and its backend is not (NCCL on a GPU)

The world's twin is made once, when the process group starts (:func:`start`, with ``trainer.collective_timeout_s``),
since ``new_group`` must be called by every rank at once. NCCL takes device tensors only: a CPU tensor over it fails
(and copying a flag to the GPU and back costs two synchronisations where gloo costs one round trip).
A subgroup whose backend is not gloo has no twin: the options that make such groups (copies of the tables) are
refused on CUDA (:func:`pipeline.training.link_choice.replication_refused`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

_world_twin: Optional[dist.ProcessGroup] = None


def start(timeout: timedelta) -> None:
    """Make the world's gloo twin where the world's backend is not gloo (collective: every rank, once)."""
    global _world_twin
    if dist.is_initialized() and dist.get_backend() != "gloo" and _world_twin is None:
        _world_twin = dist.new_group(backend="gloo", timeout=timeout)


def host_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """The group to reduce host tensors over in place of ``group`` (None: the world); see the module docstring."""
    if not dist.is_initialized() or dist.get_backend(group) == "gloo":
        return group
    if group is not None and group is not dist.group.WORLD:
        raise RuntimeError(f"host tensors over a {dist.get_backend(group)} subgroup: only the world has a gloo twin "
                           f"(pipeline.training.link_choice refuses copies of the tables on CUDA)")
    if _world_twin is None:
        raise RuntimeError("modules.host_collectives.start was not called after the process group started")
    return _world_twin


def forget() -> None:
    """Drop the twin (the process group it belongs to is being destroyed)."""
    global _world_twin
    _world_twin = None
