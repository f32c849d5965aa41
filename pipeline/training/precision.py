"""``trainer.precision=auto`` (the default): ``bf16-mixed`` where the device computes bf16 natively, else ``32-true``.

Native bf16:

* CPU: AMX-BF16 (Intel Sapphire Rapids and later) or AVX512-BF16 (Intel Cooper Lake, AMD Zen 4 and later), as the
  CPU reports them to PyTorch (``torch.cpu.get_capabilities``, the flags oneDNN dispatches its bf16 kernels on).
  Elsewhere oneDNN emulates bf16 through fp32 and a bf16 run is slower than fp32.
* CUDA: compute capability ≥ 8.0 (Ampere and later: bf16 tensor cores).

In ``bf16-mixed`` (Lightning's autocast) the dense layers multiply in bf16 with fp32 accumulation and fp32 master
weights; the loss, metrics, optimizer states, CowClip's statistics and the k-step merges stay fp32 (docs/throughput.md
says which part runs in which precision, and the AUC measured). An explicit value is honoured as given.
"""

from __future__ import annotations

import torch

AUTO = "auto"
BF16, FP32 = "bf16-mixed", "32-true"


def cpu_bf16_kernels() -> list[str]:
    """The native bf16 instruction sets of this CPU: a subset of ["AMX-BF16", "AVX512-BF16"]."""
    get = getattr(torch.cpu, "get_capabilities", None)
    caps = get() if get is not None else {}
    return [name for name, flag in (("AMX-BF16", "amx_bf16"), ("AVX512-BF16", "avx512_bf16")) if caps.get(flag)]


def native_bf16(device: str) -> tuple[bool, str]:
    """(whether ``device`` — "cpu" or "cuda" — computes bf16 natively, why)."""
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        return (major, minor) >= (8, 0), f"CUDA compute capability {major}.{minor}"
    kernels = cpu_bf16_kernels()
    return bool(kernels), (f"this CPU has {' and '.join(kernels)}" if kernels else
                           "this CPU has neither AMX-BF16 nor AVX512-BF16")


def resolve_precision(setting: str, device: str) -> tuple[str, str]:
    """(the precision a run trains in, why) for ``trainer.precision=setting`` on ``device``."""
    if setting != AUTO:
        return setting, "as set"
    native, why = native_bf16(device)
    return (BF16 if native else FP32), f"trainer.precision=auto: {why}"
