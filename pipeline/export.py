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

from pipeline.checkpointing import full_model_state
from pipeline.cli import exit_on_user_error, key_values
from pipeline.model_bundle import checkpoint_run, write_bundle


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    run = checkpoint_run(checkpoint)
    return write_bundle(out, full_model_state(run.path), run.model_cfg, run.data, run.store.meta,
                        run.store.root / "vocab")


def main(argv: list[str]) -> None:
    args = key_values(argv, required=("checkpoint", "out"), optional={})
    out = exit_on_user_error(lambda: export_checkpoint(args["checkpoint"], args["out"]))
    print(f"Exported {args['checkpoint']} to {out} (model.json, weights.pt, vocab/)")


if __name__ == "__main__":
    main(sys.argv[1:])
