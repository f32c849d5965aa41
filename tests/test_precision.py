"""``trainer.precision=auto``: bf16-mixed where the device computes bf16 natively, fp32 elsewhere; an explicit value
as given (pipeline/training/precision.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.bf16 import cpu_bf16_kernels
from pipeline.training.precision import resolve_precision


@pytest.mark.parametrize("flags, want", [
    ({"amx_bf16": True, "avx512_bf16": True}, "bf16-mixed"),   # Sapphire Rapids
    ({"amx_bf16": False, "avx512_bf16": True}, "bf16-mixed"),  # Zen 4
    ({"amx_bf16": False, "avx512_bf16": False, "avx512_f": True}, "32-true"),  # AVX-512 without bf16
    ({}, "32-true"),  # a PyTorch that reports nothing
])
def test_auto_follows_the_cpus_bf16_instructions(monkeypatch, flags, want):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(flags))
    precision, why = resolve_precision("auto", "cpu")
    assert precision == want and why.startswith("trainer.precision=auto: this CPU has")
    assert why.endswith("AVX512-BF16") and ("neither" in why) == (want == "32-true")


@pytest.mark.parametrize("capability, want", [((8, 0), "bf16-mixed"), ((9, 0), "bf16-mixed"), ((7, 5), "32-true")])
def test_auto_on_cuda_takes_compute_capability_8_and_later(monkeypatch, capability, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_precision("auto", "cuda") == (want, f"trainer.precision=auto: CUDA compute capability "
                                                       f"{capability[0]}.{capability[1]}")


@pytest.mark.parametrize("setting", ["32-true", "bf16-mixed", "16-mixed"])
def test_an_explicit_value_is_honoured_whatever_the_cpu(monkeypatch, setting):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    assert resolve_precision(setting, "cpu") == (setting, "as set")


def test_this_cpus_report_is_read():
    """On this machine: the names are the two instruction sets or nothing, from what torch reports."""
    caps = torch.cpu.get_capabilities()
    assert cpu_bf16_kernels() == [n for n, f in (("AMX-BF16", "amx_bf16"), ("AVX512-BF16", "avx512_bf16")) if caps[f]]
