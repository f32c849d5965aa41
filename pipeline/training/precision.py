"""``trainer.precision=auto`` (the default): ``bf16-mixed`` where the device computes bf16 natively, else ``32-true``.

Native bf16: :func:`pipeline.runtime.bf16.native_bf16`.

In ``bf16-mixed`` (Lightning's autocast) the dense layers multiply in bf16 with fp32 accumulation and fp32 master
weights; the loss, metrics, optimizer states, CowClip's statistics and the k-step merges stay fp32 (docs/throughput.md
says which part runs in which precision, and the AUC measured). An explicit value is honoured as given.
"""

from __future__ import annotations

from pipeline.runtime.bf16 import native_bf16

AUTO = "auto"
BF16, FP32 = "bf16-mixed", "32-true"


def resolve_precision(setting: str, device: str) -> tuple[str, str]:
    """(the precision a run trains in, why) for ``trainer.precision=setting`` on ``device``."""
    if setting != AUTO:
        return setting, "as set"
    native, why = native_bf16(device)
    return (BF16 if native else FP32), f"trainer.precision=auto: {why}"
