"""Export a checkpoint as a model folder (:mod:`pipeline.model_bundle`): unsharded weights, vocabularies,
the model and dataset description.

    python -m pipeline.export checkpoint=<checkpoint dir> out=<dir>

A checkpoint written by W processes is read in one: DCP reads every shard of a table into the whole
table. The vocabularies come from the store the run trained on (its path is in the checkpoint), which
must be on this machine. The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

from modules.models import ModelConfig
from pipeline.checkpointing import checked_checkpoint, full_model_state, read_rank0_state
from pipeline.cli import exit_on_user_error, key_values
from pipeline.data.store import ColumnarStore
from pipeline.model_bundle import BundleError, declaration_from, write_bundle


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    path = checked_checkpoint(checkpoint)
    run = read_rank0_state(path)["pipeline"].get("run")
    if run is None:
        raise BundleError(f"{path}: the checkpoint does not describe its model and data (written by an older "
                          f"version); export the model folder of a newer run instead")
    try:
        store = ColumnarStore(run["store"])
    except (FileNotFoundError, ValueError) as e:
        raise BundleError(f"{path}: the store the run trained on is needed for its vocabularies: {e}") from None
    weights = full_model_state(path)
    return write_bundle(out, weights, ModelConfig(**run["model"]), declaration_from(run["data"]), store.meta,
                        store.root / "vocab")


def main(argv: list[str]) -> None:
    args = key_values(argv, required=("checkpoint", "out"), optional={})
    out = exit_on_user_error(lambda: export_checkpoint(args["checkpoint"], args["out"]))
    print(f"Exported {args['checkpoint']} to {out} (model.json, weights.pt, vocab/)")


if __name__ == "__main__":
    main(sys.argv[1:])
