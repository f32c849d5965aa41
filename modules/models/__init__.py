"""CTR models over a shared TorchRec embedding layer; ``build_model`` selects one by name."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from modules.embedding import FeatureSpec
from modules.models.deepfm import DeepFM

MODELS: dict[str, Callable[..., nn.Module]] = {"deepfm": DeepFM}


def build_model(name: str, spec: FeatureSpec, params: dict[str, Any], device: torch.device | None = None) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model.name={name!r} is not a known model; expected one of {sorted(MODELS)}")
    return MODELS[name](spec, device=device, **params)
