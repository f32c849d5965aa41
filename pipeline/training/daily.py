"""Keeping a model fresh day after day: train day N from day N−1's model, scoring day N with that model
before training on it (the "next-day AUC" production teams track).

    ctr daily 'data.path=[day_0.csv,day_1.csv,day_2.csv]'

Day N is one ordinary run (its own MLflow run, named ``day N``; its folder ``<output>/day_N``) with
``data.path=<day N>``, ``trainer.init_from`` and ``data.preprocess.base_vocabulary`` set to day N−1's
model folder: known values keep their ids and rows, new ones are appended (:mod:`pipeline.training.init_from`);
with ``trainer.init_from_optimizer`` each day also writes checkpoints, and the next day starts from the
newest one, carrying its optimizer state.
Before day N trains, day N−1's model scores all of day N's rows (:mod:`pipeline.scoring.prediction`); that AUC is
logged to day N−1's run as ``next_day/auc`` (and ``next_day/logloss``). At the end a plot of next-day
AUC over the days (``next_day_auc.png``) and its table go to the output folder and to the last day's
run. One process (each day's run may not be under ``torchrun`` here; start a day from the previous
day's model by hand with ``trainer.init_from`` for that).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.checkpoint.discovery import newest_intact_checkpoint
from pipeline.config import parse_config
from pipeline.runtime.errors import ConfigError
from pipeline.scoring.prediction import PredictArgs
from pipeline.scoring.prediction import run as predict
from pipeline.training.result import RunResult
from pipeline.training.run import train


@dataclass
class Day:
    file: str
    result: RunResult
    next_day_auc: float | None = None
    next_day_logloss: float | None = None


def days_of(cfg: DictConfig) -> list[str]:
    paths = cfg.data.path
    if not OmegaConf.is_list(paths) or len(paths) < 2:
        raise ConfigError("data.path: ctr daily needs a list of at least two day files, in order: "
                          "'data.path=[day_0.csv,day_1.csv]'")
    return [str(p) for p in paths]


def _day_config(cfg: DictConfig, file: str, index: int, folder: Path, start: Path | None,
                vocabulary: Path | None) -> DictConfig:
    """Day ``index``'s run in ``folder``: from ``start`` (a model folder, or a checkpoint to carry the
    optimizer state from) with ``vocabulary``'s ids, or from scratch."""
    day = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(day):
        day.data.path = file
        day.logger.log_model = True  # the next day starts from it
        day.logger.run_name = f"day {index}"
        if cfg.trainer.init_from_optimizer != "none":  # the next day needs a checkpoint (a model folder holds weights)
            day.trainer.checkpoint.dir = str(folder / "checkpoints")
        if start is not None:
            day.trainer.init_from = str(start)
            day.data.preprocess.base_vocabulary = str(vocabulary)
        else:
            day.trainer.init_from_optimizer = "none"
    return day


def _next_start(cfg: DictConfig, folder: Path) -> Path:
    """What the day after the one trained in ``folder`` starts from."""
    if cfg.trainer.init_from_optimizer == "none":
        return folder / "model"
    found = newest_intact_checkpoint(folder / "checkpoints")
    if found is None:
        raise ConfigError(f"trainer.init_from_optimizer: {folder / 'checkpoints'} holds no intact checkpoint to carry "
                          f"the optimizer state from")
    return found


def _score(model: Path, file: str, out: Path) -> tuple[float | None, float | None]:
    result = predict(PredictArgs(checkpoint=str(model), input=file, output=str(out)))
    return result.auc, result.logloss


def plot(days: list[Day], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [(i, d) for i, d in enumerate(days) if d.next_day_auc is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([i + 1 for i, _ in scored], [d.next_day_auc for _, d in scored], marker="o")
    ax.set_xlabel("day scored (by the model trained up to the day before)")
    ax.set_ylabel("next-day AUC")
    ax.set_xticks([i + 1 for i, _ in scored])
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run_daily(cfg: DictConfig, output_dir: Path) -> list[Day]:
    """Train the days in order (module docstring); returns each day's result and next-day scores."""
    files = days_of(cfg)
    previous: Path | None = Path(cfg.trainer.init_from) if cfg.trainer.init_from else None  # a model folder
    parse_config(_day_config(cfg, files[0], 0, output_dir / "day_0", previous, previous))  # every key, once
    days: list[Day] = []
    start = previous
    client = MlflowClient(cfg.logger.tracking_uri)
    for index, file in enumerate(files):
        folder = output_dir / f"day_{index}"
        if previous is not None and days:
            auc, logloss = _score(previous, file, folder.with_name(f"day_{index}_scored_by_day_{index - 1}.parquet"))
            days[-1].next_day_auc, days[-1].next_day_logloss = auc, logloss
            if days[-1].result.mlflow_run_id:
                client.log_metric(days[-1].result.mlflow_run_id, "next_day/auc", auc, step=index)
                client.log_metric(days[-1].result.mlflow_run_id, "next_day/logloss", logloss, step=index)
            print(f"day {index - 1}'s model on day {index} ({file}): AUC {auc:.6f}, logloss {logloss:.6f}", flush=True)
        result = train(_day_config(cfg, file, index, folder, start, previous), folder)
        days.append(Day(file, result))
        previous, start = folder / "model", _next_start(cfg, folder)
    table = ["| day | file | test AUC (own split) | next-day AUC |", "|---:|---|---:|---:|"]
    table += [f"| {i} | {d.file} | {d.result.test_auc:.4f} | "
              f"{'' if d.next_day_auc is None else f'{d.next_day_auc:.4f}'} |" for i, d in enumerate(days)]
    (output_dir / "next_day_auc.md").write_text("\n".join(table) + "\n")
    figure = plot(days, output_dir / "next_day_auc.png")
    last = days[-1].result.mlflow_run_id
    if last:
        for artifact in (figure, output_dir / "next_day_auc.md"):
            client.log_artifact(last, str(artifact))
    return days
