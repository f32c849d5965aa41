"""``ctr daily 'data.path=[day_0.csv,day_1.csv,...]' [key=value] ...``: keep a model fresh day after day
(:mod:`pipeline.training.daily`): each day trains from the previous day's model, after that model has
scored the day (the next-day AUC)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from pipeline.commands.args import exit_on_user_error
from pipeline.config import register_configs
from pipeline.runtime.hydra_job import output_dir
from pipeline.training.daily import run_daily
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path


@hydra.main(version_base="1.3", config_path=config_path(), config_name="config")
def main(cfg: DictConfig) -> None:
    folder = output_dir()
    days = exit_on_user_error(lambda: run_daily(cfg, folder))
    print(f"Trained {len(days)} days; next-day AUC: "
          f"{', '.join(f'{d.next_day_auc:.4f}' for d in days if d.next_day_auc is not None)} "
          f"(next_day_auc.png, next_day_auc.md in {folder})", flush=True)


def cli() -> None:
    """``ctr daily`` / ``python -m pipeline.commands.daily``."""
    register_configs()
    check_overrides(config_path(), "config")
    main()


if __name__ == "__main__":
    cli()
