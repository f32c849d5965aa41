"""The ``ctr`` command (``[project.scripts]``): ``ctr <command> [key=value ...]``.

Every command takes Hydra overrides (``key=value``, ``group=option``) composed onto its typed config
from the installed ``ctr_conf`` package, and ``ctr <command> --help`` lists its keys with their
defaults. ``python -m pipeline.commands.<command>`` runs the same code.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # command → (module with cli(), what it does)
    "train": ("pipeline.commands.train", "train and test a model (groups: data, model, optim, scaling, topology, trainer, ...)"),
    "daily": ("pipeline.commands.daily", "train the days of data.path in turn, each scored by the day before's model"),
    "predict": ("pipeline.commands.predict", "score raw rows with a model folder or checkpoint"),
    "serve": ("pipeline.commands.serve", "an HTTP scoring server: MLflow's protocol, dynamic batching, hot model swap"),
    "export": ("pipeline.commands.export", "write a checkpoint as an unsharded model folder"),
    "plan": ("pipeline.commands.plan", "show where the embedding tables go on a topology"),
    "report": ("pipeline.commands.report", "batch-scaling table and plot from MLflow runs"),
    "sync": ("pipeline.commands.sync", "replay a local fallback MLflow store to its tracking server"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: ctr <command> [key=value ...]   (ctr <command> --help: its keys and defaults)\n\ncommands:\n"
            + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        print(f"ctr: unknown command {argv[0]!r}\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    sys.argv = [f"ctr {argv[0]}", *argv[1:]]
    module.cli()


if __name__ == "__main__":
    main()
