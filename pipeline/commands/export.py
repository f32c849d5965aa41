"""``ctr export``: a checkpoint (or a model folder) as a model folder, its tables quantized on request (:mod:`pipeline.model_folder.export`): unsharded weights, vocabularies,
the model and dataset description.

    ctr export checkpoint=<checkpoint dir, or a run's trainer.checkpoint.dir> out=<dir> [quantize=int8|int4|fp16]

A checkpoint written by W processes is read in one: DCP reads every shard of a table into the whole
table. The vocabularies come from the store the run trained on (its path is in the checkpoint), which
must be on this machine. The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

from dataclasses import dataclass

import hydra
from omegaconf import MISSING, DictConfig

from pipeline.commands.args import command_args, exit_on_user_error
from pipeline.model_folder.export import export_model
from pipeline.model_folder.quantize import check_quantize
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path


@dataclass
class ExportArgs:
    """``conf/export.yaml``."""

    checkpoint: str = MISSING
    out: str = MISSING
    quantize: str = "none"  # the tables: none (float32) | int8 | int4 | fp16 (pipeline/model_folder/quantize.py)

    def __post_init__(self) -> None:
        check_quantize(self.quantize, "quantize")


@hydra.main(version_base="1.3", config_path=config_path(), config_name="export")
def main(cfg: DictConfig) -> None:
    args = command_args(cfg, ExportArgs)
    out = exit_on_user_error(lambda: export_model(args.checkpoint, args.out, args.quantize))
    tables = "tables/" if args.quantize == "none" else f"tables/ ({args.quantize})"
    print(f"Exported {args.checkpoint} to {out} (model.json, weights.pt, {tables}, vocab/)")


def cli() -> None:
    """``ctr export`` / ``python -m pipeline.commands.export``."""
    check_overrides(config_path(), "export")
    main()


if __name__ == "__main__":
    cli()
