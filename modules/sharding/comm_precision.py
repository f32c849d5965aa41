"""Reduced-precision communication: fewer bytes across a slow link for the same step.

- Pooled embeddings' all-to-all: TorchRec's quantized comms (``QCommsConfig`` → ``qcomm_codecs_registry`` on
  the embedding sharders; FBGEMM's quantize ops, which run on CPU and gloo). The forward sends each pooled
  vector in ``embedding_forward`` precision and the backward its gradient in ``embedding_backward``; the
  lookups, the optimizer and the tables stay fp32. Bytes per value: fp32 4, fp16/bf16 2, int8 1 (+ 8 per
  row for its scale and bias). TorchRec's own recommendation is fp16 forward, bf16 backward (bf16 keeps
  fp32's range for gradients; fp16 keeps 3 more mantissa bits for values of moderate range); on CPU TorchRec
  sends bf16 as fp16 (``fbgemm_qcomm_codec``: gloo), so bf16 is refused there (``check_runnable``) and the
  link choice takes fp16 both ways.
- DDP's dense gradient all-reduce (``trainer.merging.k=null``): PyTorch's fp16/bf16 compression hooks
  (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): each bucket cast, all-reduced, divided by
  the world size and cast back. With k-step merging, the merges' dense updates (θ_r − θ at the last merge) in
  this precision (:mod:`modules.optim.kstep_merging`).

``auto`` is resolved by :mod:`modules.sharding.link_plan` from the stated inter-node link; ``fp32`` is the
plain collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from modules.comm_accounting import ddp_counting_hook

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
_COMM_TYPE = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16", "int8": "INT8"}


@dataclass
class CommsConfig:
    """``trainer.comms``: the precision each collective sends in (``auto``: chosen from the stated link)."""

    embedding_forward: str = "auto"   # pooled embeddings' all-to-all: fp32 | fp16 | bf16 | int8 | auto
    embedding_backward: str = "auto"  # their gradients: fp32 | fp16 | bf16 | auto
    dense: str = "auto"               # DDP's gradient all-reduce, or k-step merges' updates: fp32 | fp16 | bf16 | auto

    def __post_init__(self) -> None:
        for key, allowed in (("embedding_forward", PRECISIONS), ("embedding_backward", PRECISIONS[:3]),
                             ("dense", PRECISIONS[:3])):
            value = getattr(self, key)
            if value != "auto" and value not in allowed:
                extra = " (int8 is offered for the forward only: gradients in int8 were not measured here)" \
                    if value == "int8" else ""
                raise ValueError(f"{key}={value!r}: expected one of {', '.join(allowed)} or auto{extra}")

    @property
    def resolved(self) -> bool:
        return "auto" not in (self.embedding_forward, self.embedding_backward, self.dense)


def dense_allreduce_in(model: nn.Module, precision: str) -> None:
    """``model``'s DDP (if its dense part has one) all-reduces in ``precision`` over the DDP's own process group (all
    ranks, or one node's), counted (:func:`modules.comm_accounting.ddp_counting_hook`: DDP's all-reduce runs in C++)."""
    dense = getattr(model, "_dmp_wrapped_module", None)
    if isinstance(dense, DistributedDataParallel):
        dense.register_comm_hook((dense_allreduce_hook(precision), dense.process_group), ddp_counting_hook)


def qcomm_registry(cfg: CommsConfig) -> dict | None:
    """The ``qcomm_codecs_registry`` for TorchRec's embedding sharders; None for fp32 both ways."""
    if not cfg.resolved:
        raise ValueError(f"trainer.comms has unresolved values: {cfg}")
    if (cfg.embedding_forward, cfg.embedding_backward) == ("fp32", "fp32"):
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType[_COMM_TYPE[cfg.embedding_forward]],
                                                  backward_precision=CommType[_COMM_TYPE[cfg.embedding_backward]]))


def dense_allreduce_hook(precision: str):
    """DDP communication hook for the dense all-reduce in ``precision`` (fp32: DDP's plain all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"fp32": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}
    return hooks[precision]
