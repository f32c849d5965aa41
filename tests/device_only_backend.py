"""A process-group backend standing in for NCCL on a machine without a GPU: it takes no host tensor.

NCCL cannot start without a GPU ("ProcessGroupNCCL is only supported with GPUs"); this backend starts anywhere and
refuses every collective, as NCCL refuses a CPU tensor. Made the default group, it fails every collective of host
tensors that would reach NCCL on a GPU: the project's must go over :func:`modules.host_collectives.host_group`.
"""

from __future__ import annotations

import torch.distributed as dist

NAME = "device_only"
REFUSAL = "device_only: a host tensor over the device's process group (NCCL takes device tensors only)"


class DeviceOnlyGroup(dist.ProcessGroup):
    def getBackendName(self) -> str:
        return NAME

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(REFUSAL)

    allreduce = allgather = _allgather_base = allgather_into_tensor_coalesced = broadcast = gather = scatter = \
        reduce = reduce_scatter = alltoall = alltoall_base = send = recv = barrier = _refuse


def register() -> None:
    """Make ``init_process_group("device_only", ...)`` possible in this process."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, lambda store, rank, size, timeout: DeviceOnlyGroup(rank, size),
                                      devices=["cuda"])
