"""CTR models over a shared TorchRec embedding layer; ``build_model`` selects one by name.

Every model takes ``device`` for its embedding collection only (the meta device when it is going to
be sharded: DistributedModelParallel materialises each shard on its rank); the dense layers are built
on the CPU with their usual initialisation (seeded: identical on every rank) and moved by DMP.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from modules.embedding import FeatureSpec
from functools import partial

from modules.models.dcn import DCN
from modules.models.deepfm import DeepFM
from modules.models.wide_deep import WideDeep

MODELS: dict[str, Callable[..., nn.Module]] = {
    "deepfm": DeepFM,
    "wide_deep": WideDeep,
    "dcn": partial(DCN, cross="vector"),
    "dcnv2": partial(DCN, cross="full"),
}


def build_model(name: str, spec: FeatureSpec, params: dict[str, Any], device: torch.device | None = None) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model.name={name!r} is not a known model; expected one of {sorted(MODELS)}")
    return MODELS[name](spec, device=device, **params)
