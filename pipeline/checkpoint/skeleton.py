"""A Lightning checkpoint dict as tensors (written through DCP) and a JSON skeleton (the rest).

Everything but tensors — loop progress, counters, config, MLflow run id — goes to one JSON file per
rank, ``trainer_state.rank<r>.json``, with placeholders ``{"__tensor__": key, "shape": ..., "dtype":
...}`` where tensors were. Keys of ``GLOBAL_KEYS`` (sharded or replicated) are stored once; the rest
under ``rank<r>/``, so each rank gets its own back; copy c's fused optimizer state of copies of the tables under
``fused_optimizer.copy<c>``.
"""

from __future__ import annotations

from typing import Any

import torch

STATE_FILE = "trainer_state.rank{rank}.json"
GLOBAL_KEYS = ("state_dict", "fused_optimizer")  # sharded or replicated: one copy in the checkpoint
PER_COPY = "fused_optimizer.copy"  # + c: copy c's fused optimizer state (copies of the tables), its ranks' shards once


def stored_once(key: str) -> bool:
    """Whether a top-level key's tensors are stored once for the ranks holding them (else under ``rank<r>/``)."""
    return key in GLOBAL_KEYS or key.startswith(PER_COPY)


def split_tensors(obj: Any, prefix: str, tensors: dict[str, Any]) -> Any:
    """Replace tensors (and ShardedTensors) in a nested structure by placeholders; collect them."""
    if torch.is_tensor(obj) or hasattr(obj, "local_shards"):
        tensors[prefix] = obj
        shape = list(obj.size()) if hasattr(obj, "size") else list(obj.shape)
        return {"__tensor__": prefix, "shape": shape, "dtype": str(obj.dtype).removeprefix("torch."),
                "sharded": hasattr(obj, "local_shards")}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{prefix}: checkpoint dict keys must be str or int")
        return {"__dict__": [[k, split_tensors(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{prefix}: cannot store a {type(obj).__name__} in a checkpoint (only tensors, "
                    f"numbers, strings and containers)")


def join_tensors(obj: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: join_tensors(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: join_tensors(v, tensors) for k, v in obj.items()}  # the top level
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj


def placeholders(obj: Any) -> list[dict]:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return [obj]
        values = [v for _, v in obj["__dict__"]] if "__dict__" in obj else obj.get("__tuple__", list(obj.values()))
        return [p for v in values for p in placeholders(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in placeholders(v)]
    return []


def without_tensors(skeleton: dict[str, Any]) -> dict[str, Any]:
    """A state file's contents with None where its tensors go."""
    return join_tensors(skeleton, {p["__tensor__"]: None for p in placeholders(skeleton)})
