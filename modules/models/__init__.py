"""CTR models over a shared TorchRec embedding layer; :func:`build_model` builds one from ``model``.

Every model takes ``device`` for its embedding collection only (the meta device when it is going to
be sharded: DistributedModelParallel materialises each shard on its rank); the dense layers are built
on the CPU with their usual initialisation (seeded: identical on every rank) and moved by DMP.

May import: modules.embedding
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from modules.embedding.sparse_arch import FeatureSpec
from modules.embedding.table_precision import check_table_precision
from modules.models.dcn import DCN
from modules.models.deepfm import DeepFM
from modules.models.wide_deep import WideDeep
from modules.embedding.zch.config import ZchConfig

MODELS: dict[str, Callable[..., nn.Module]] = {
    "deepfm": DeepFM,
    "wide_deep": WideDeep,
    "dcn": partial(DCN, cross="vector"),
    "dcnv2": partial(DCN, cross="full"),
}


@dataclass
class ModelConfig:
    """``model`` (``conf/model/*.yaml``): the architecture and its sizes. The cross-network keys are
    DCN / DCN-v2 only (None: not set)."""

    name: str = "deepfm"
    embedding_dim: int = 16
    mlp: List[int] = field(default_factory=lambda: [400, 400, 400])
    dropout: float = 0.0
    batch_norm: bool = False
    bn_momentum: float = 0.1     # BatchNorm running-stat momentum (PyTorch convention)
    init_std: float = 0.01
    cross_layers: Optional[int] = None
    low_rank: Optional[int] = None
    num_experts: Optional[int] = None
    wide: Optional[bool] = None
    # the bag collection's tables as one stacked table (modules/embedding/sparse_arch.py): true | false | auto (decided
    # against the topology before the model is built, modules/sharding/table_stacking.py)
    stack_tables: Union[bool, str] = "auto"
    # the MLP's hidden layers (Linear + ReLU) on oneDNN's fp32 GEMM when they run on the CPU in fp32
    # (modules/models/onednn_linear.py); false: PyTorch's default kernels (MKL). Same model, float rounding apart
    onednn_mlp: bool = True
    # CPU, one process, 2+ threads: the lookups' backward (FBGEMM's serial loop and its fused update) on a
    # second thread beside the MLP's weight gradients, or before them where the measured step is shorter so (another
    # process on the cores): the same bits either way (modules/models/backward_overlap.py). false: the plain backward
    overlap_embedding_backward: bool = True
    # the type embedding rows are stored and updated in: fp32 | fp16 | bf16 (CUDA only), FBGEMM's weights_precision
    # (modules/embedding/table_precision.py); the optimizer state stays fp32
    table_precision: str = "fp32"
    # raw 64-bit ids (data.preprocess.categorical=raw) mapped to table rows without collisions, with eviction
    # (modules/embedding/zch/remapper.py); rows 0: off
    zch: ZchConfig = field(default_factory=ZchConfig)

    def __post_init__(self) -> None:
        if self.name not in MODELS:
            raise ValueError(f"name={self.name!r} is not a known model; expected one of {sorted(MODELS)}")
        if self.embedding_dim <= 0 or self.embedding_dim % 4:
            raise ValueError(f"embedding_dim={self.embedding_dim}: must be a positive multiple of 4 (FBGEMM kernels)")
        if not isinstance(self.stack_tables, bool) and self.stack_tables != "auto":
            raise ValueError(f"stack_tables={self.stack_tables!r}: expected true, false or auto")
        check_table_precision(self.table_precision, "table_precision")
        taken = inspect.signature(MODELS[self.name]).parameters
        extra = [k for k, v in self.arguments().items() if k not in taken]
        if extra:
            raise ValueError(f"{extra[0]}={getattr(self, extra[0])}: model {self.name!r} takes no {extra[0]!r}")

    @classmethod
    def from_saved(cls, saved: dict) -> "ModelConfig":
        """The config a model folder or checkpoint recorded; one written before ``stack_tables`` existed
        has a table per feature."""
        saved = {"stack_tables": False, **saved}
        return cls(**{**saved, "zch": ZchConfig(**saved.get("zch", {}))})

    def arguments(self) -> dict:
        """The constructor's keyword arguments: everything set, but the name."""
        return {k: v for k, v in asdict(self).items() if k not in ("name", "zch") and v is not None}


def build_model(cfg: ModelConfig, spec: FeatureSpec, device: torch.device | None = None) -> nn.Module:
    """The model of ``cfg``: its embedding collections on ``device``, the rest on the CPU whatever the default device
    (Lightning builds under ``torch.device(root_device)``), drawn from the CPU generator: the same values on any device."""
    if cfg.stack_tables == "auto":
        raise ValueError("model.stack_tables=auto is decided against the topology before the model is built "
                         "(modules.sharding.table_stacking.decide_stacking)")
    with torch.device("cpu"):
        return MODELS[cfg.name](spec, device=device, **cfg.arguments())
