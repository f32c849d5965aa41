"""``ctr predict``: score raw rows with a model folder or checkpoint (:mod:`pipeline.scoring.prediction`).

    ctr predict checkpoint=<model folder | checkpoint dir> input=<file, list, dir or glob> \
        output=<file.parquet | file.csv> [batch_size=65536]
    torchrun --nproc_per_node=2 -m pipeline.commands.predict checkpoint=<checkpoint dir> ...
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from pipeline.commands.args import command_args, exit_on_user_error
from pipeline.runtime.process_exit import exit_now, leave_process_group
from pipeline.scoring.prediction import PredictArgs, run
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path


@hydra.main(version_base="1.3", config_path=config_path(), config_name="predict")
def main(cfg: DictConfig) -> None:
    args = command_args(cfg, PredictArgs)
    try:
        result = exit_on_user_error(lambda: run(args))
    finally:
        leave_process_group()
    if result is not None:
        scores = f"; AUC {result.auc:.6f}, logloss {result.logloss:.6f}" if result.auc is not None else ""
        print(f"Wrote {result.rows} predictions to {result.output}{scores}", flush=True)
        if result.unseen is not None:
            unseen, looked_up = result.unseen
            print(f"model.zch: {unseen:,} of {looked_up:,} raw ids ({unseen / max(1, looked_up):.2%}) were not held "
                  f"at training and read the unknown row", flush=True)


def cli() -> None:
    """``ctr predict`` / ``python -m pipeline.commands.predict``."""
    check_overrides(config_path(), "predict")
    main()
    exit_now(0)  # no interpreter teardown: under torchrun a gloo worker may still be ending (pipeline.runtime.process_exit)


if __name__ == "__main__":
    cli()
