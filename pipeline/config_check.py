"""Checks a composed config before any work starts; errors name the offending key."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from modules.models import MODELS
from modules.optimizers import OPTIMIZERS
from pipeline.data.schema import SCHEMAS
from pipeline.data.sources import raw_fingerprint

PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def world_from_env() -> tuple[int, int]:
    """(world size, ranks per node) as torchrun sets them; (1, 1) for a plain process."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _positive_int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key}={value!r}: expected a positive integer")
    return value


def check_config(cfg: Mapping[str, Any]) -> None:
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    world, _ = world_from_env()
    model, optim, trainer, data, topo = (cfg[k] for k in ("model", "optim", "trainer", "data", "topology"))
    if model.get("name") not in MODELS:
        raise ConfigError(f"model.name={model.get('name')!r} is not a known model; expected one of {sorted(MODELS)}")
    if _positive_int(model.get("embedding_dim"), "model.embedding_dim") % 4:
        raise ConfigError(f"model.embedding_dim={model['embedding_dim']}: must be a multiple of 4 (FBGEMM kernels)")
    for part in ("dense", "embedding"):
        name = (optim.get(part) or {}).get("name")
        if name not in OPTIMIZERS:
            raise ConfigError(f"optim.{part}.name={name!r}: expected one of {sorted(OPTIMIZERS)}")
    for key in ("batch_size", "eval_batch_size"):
        bs = _positive_int(trainer.get(key), f"trainer.{key}")
        if bs % world:
            raise ConfigError(f"trainer.{key}={bs} is not divisible by the world size {world} (WORLD_SIZE); "
                              f"each rank needs an equal share of the global batch")
    _positive_int(trainer.get("max_epochs"), "trainer.max_epochs")
    if str(trainer.get("precision")) not in PRECISIONS:
        raise ConfigError(f"trainer.precision={trainer.get('precision')!r}: expected one of {PRECISIONS}")
    device = topo.get("compute_device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"topology.compute_device={device!r}: expected 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("topology.compute_device='cuda' but no CUDA device is available; use topology=cpu")
    if data.get("schema") not in SCHEMAS:
        raise ConfigError(f"data.schema={data.get('schema')!r}: expected one of {sorted(SCHEMAS)}")
    try:
        raw_fingerprint(data)
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise ConfigError(str(e)) from e
