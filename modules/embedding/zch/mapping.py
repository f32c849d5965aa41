"""The ``model.zch`` mapping as state: gathered for a model folder (:func:`mapping_state`), continued by a next run
(:func:`load_mapping_state`), and read-only for scoring (:func:`lookup_rows`: as training remaps)."""

from __future__ import annotations

from itertools import count, takewhile

import numpy as np
import torch

from modules.embedding.zch.config import FIRST_ROW, MISSING_ROW
from modules.embedding.zch.exchange import bucket_of
from modules.embedding.zch.remapper import BUCKET_MARK, HELD, ROWS, ZchRemapper, held_rows


def mapping_state(remapper: ZchRemapper) -> dict[str, np.ndarray] | None:
    """The mapping of every table: the remapper's state dict without the ids waiting for a round — TorchRec's
    buffers ``mch.<unit>.<buffer>`` (ids held, sorted, their rows, the policy's metadata, the round count) and
    the probation lists ``admission.<unit>.ids`` / ``.counts`` / ``.last`` if any; a unit is a table, or
    ``<table>@<bucket>`` with ``model.zch.buckets`` > 1. What a model folder keeps to score, and a next day
    continues from; a checkpoint holds the same keys under ``state_dict/zch.remapper.``. On rank 0 (every rank
    calls it and sends its units'), None on the others."""
    mine = {k: v.numpy().copy() for k, v in remapper.state_dict().items() if isinstance(v, torch.Tensor)}
    parts = remapper.exchange.to_first(mine)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def load_mapping_state(remapper: ZchRemapper, state: dict[str, np.ndarray] | None) -> None:
    """Continue from :func:`mapping_state` (``trainer.init_from``): same ids on the same rows (this rank's
    units); the probation lists where both runs keep them."""
    if not state:
        raise ValueError("trainer.init_from: the source model has no model.zch mapping (it was trained on a "
                         "vocabulary or hashed ids); start this raw-id run afresh")
    known = {name for _, _, name, _ in remapper.units}
    unexpected = [k for k in state if k.startswith("mch.") and k.split(".")[1] not in known]
    own = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items() if k.split(".")[1] in remapper.mch}
    missing = [k for k in remapper.load_state_dict(own, strict=False).missing_keys if k.startswith("mch.")]
    if missing or unexpected:
        raise ValueError(f"trainer.init_from: the source's model.zch mapping does not fit this run's tables "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}; model.zch.buckets must be the source's)")


def lookup_rows(state: dict[str, np.ndarray], table: str, raw: np.ndarray) -> np.ndarray:
    """Read-only remap of raw ids (int64) with a table's :func:`mapping_state`, as training remaps
    (:func:`held_rows`, in the id's bucket); missing (0) → row 1; the unknown row is the table's last."""
    names = [table] if f"mch.{table}.{HELD}" in state else \
        list(takewhile(lambda n: f"mch.{n}.{HELD}" in state, (f"{table}{BUCKET_MARK}{b}" for b in count())))
    if not names:
        raise ValueError(f"the model.zch mapping holds no table {table!r}")
    held = [torch.from_numpy(state[f"mch.{n}.{HELD}"]) for n in names]
    rows = [torch.from_numpy(state[f"mch.{n}.{ROWS}"]) for n in names]
    unknown = FIRST_ROW + sum(len(h) for h in held) - 1
    raw = torch.from_numpy(np.asarray(raw, dtype=np.int64))
    if len(names) == 1:
        out = held_rows(held[0], rows[0], unknown, raw)
    else:
        bucket, out = bucket_of(raw, len(names)), torch.empty_like(raw)
        for b in range(len(names)):
            at = bucket == b
            out[at] = held_rows(held[b], rows[b], unknown, raw[at])
    out[raw == 0] = MISSING_ROW
    return out.numpy()
