"""Keep each rank next to its GPU: its threads (data loading, pinned host buffers, which are placed
by first touch) run on the CPUs of the GPU's NUMA node. Nothing happens without CUDA.

The GPU's NUMA node comes from the topology config (``topology.numa[local_rank]``) or from Linux:
``/sys/bus/pci/devices/<PCI bus id>/numa_node``; its CPUs from
``/sys/devices/system/node/node<N>/cpulist``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

log = logging.getLogger(__name__)


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` → {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pci_bus_id(device: int) -> str:
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def gpu_numa_node(bus_id: str, sysfs: str | Path = "/sys") -> int | None:
    path = Path(sysfs) / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: str | Path = "/sys") -> set[int]:
    path = Path(sysfs) / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        return parse_cpulist(path.read_text())
    except OSError:
        return set()


def bind_to_gpu_numa_node(local_rank: int, numa: Sequence[int] | None = None, sysfs: str | Path = "/sys",
                          cuda_available: bool | None = None) -> int | None:
    """Pin this process to the CPUs of its GPU's NUMA node; returns the node (None: nothing done)."""
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        return None
    node = numa[local_rank] if numa is not None and local_rank < len(numa) else gpu_numa_node(pci_bus_id(local_rank), sysfs)
    if node is None:
        return None
    cpus = node_cpus(node, sysfs) & os.sched_getaffinity(0)
    if not cpus:
        log.warning("NUMA node %s of GPU %s has no usable CPUs; not pinning", node, local_rank)
        return None
    os.sched_setaffinity(0, cpus)
    log.info("rank on GPU %s pinned to NUMA node %s (%d CPUs)", local_rank, node, len(cpus))
    return node
