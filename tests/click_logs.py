"""A generated "user's own" click log with numeric, categorical, time and multi-hot columns, and its oracle.

    logit = b + u[user] + 0.4·(log1p(price) − 1.5) + 0.3·[hour ≥ 18] + s · mean_{t ∈ tags} v[t]

with u ~ N(0, 0.4²) over 200 users, v ~ N(0, 1) over 300 tags, 1–6 tags per row (each row's tags
drawn from a Zipf-like law), ``s`` the weight of the multi-hot column. The oracle is the AUC of the
true probabilities: what a model that knew the generator would reach.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torchmetrics.functional.classification import binary_auroc

USERS, TAGS = 200, 300


def click_log(rows: int, seed: int = 0, tag_weight: float = 2.0, first_user: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """(the log as a DataFrame of raw columns, the true click probability of every row); users are
    ``first_user`` … ``first_user + 199`` (later days: a shifted window of the same user population)."""
    rng = np.random.default_rng(seed)
    world = np.random.default_rng(1234)  # the click model is the same for every seed
    u, v = world.normal(0, 0.4, USERS), world.normal(0, 1.0, TAGS)
    u = np.concatenate([u, world.normal(0, 0.4, 9 * USERS)])  # users of later windows
    user = first_user + rng.integers(0, USERS, rows)
    price = rng.lognormal(1.0, 1.0, rows).round(2)
    seconds = 1_510_000_000 + rng.integers(0, 7 * 86400, rows)
    hour = (seconds // 3600) % 24
    n_tags = rng.integers(1, 7, rows)
    tag_ids = np.minimum(rng.integers(0, TAGS, n_tags.sum()), rng.integers(0, TAGS, n_tags.sum()))
    starts = np.concatenate([[0], np.cumsum(n_tags)[:-1]])
    tag_mean = np.add.reduceat(v[tag_ids], starts) / n_tags
    logit = -1.0 + u[user] + 0.4 * (np.log1p(price) - 1.5) + 0.3 * (hour >= 18) + tag_weight * tag_mean
    p = 1 / (1 + np.exp(-logit))
    clicked = (rng.random(rows) < p).astype(int)
    tags = ["|".join(f"t{t}" for t in tag_ids[s:s + n]) for s, n in zip(starts, n_tags)]
    times = pd.to_datetime(seconds, unit="s").strftime("%Y-%m-%d %H:%M:%S")
    frame = pd.DataFrame({"clicked": clicked, "user_id": [f"u{x}" for x in user], "price": price,
                          "click_time": times, "tags": tags})
    return frame, p


def oracle_auc(frame: pd.DataFrame, p: np.ndarray) -> float:
    return float(binary_auroc(torch.from_numpy(p), torch.tensor(frame["clicked"].to_numpy())))


DATASET_YAML = """\
name: mylog
format: csv
path: ???
header: true
label: clicked
features:
  - {name: user_id, type: categorical}
  - {name: price, type: numeric, transform: log1p}
  - {name: hour, column: click_time, type: categorical, derive: hour_of_day}
  - {name: tags, type: sequence, separator: "|", max_length: 10, pooling: mean}
preprocess:
  min_count: 2
  split: {method: random, valid: 0.1, test: 0.2, seed: 0}
"""


def write_dataset(folder: Path, yaml_text: str = DATASET_YAML, name: str = "mylog") -> Path:
    """``<folder>/data/<name>.yaml``: a config folder for ``--config-dir`` holding the declaration."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    path = folder / "data" / f"{name}.yaml"
    path.write_text(yaml_text)
    return path
