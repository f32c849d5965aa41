"""Whether a device computes bf16 natively (what ``trainer.precision=auto`` and ``serve.rank_dense=auto`` read):

* CPU: AMX-BF16 (Intel Sapphire Rapids and later) or AVX512-BF16 (Intel Cooper Lake, AMD Zen 4 and later), as the
  CPU reports them to PyTorch (``torch.cpu.get_capabilities``, the flags oneDNN dispatches its bf16 kernels on).
  Elsewhere oneDNN emulates bf16 through fp32 and a bf16 GEMM is slower than an fp32 one.
* CUDA: compute capability ≥ 8.0 (Ampere and later: bf16 tensor cores).
"""

from __future__ import annotations

import torch


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
