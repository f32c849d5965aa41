"""The training pipeline around :mod:`modules` (the models and the algorithms), by the stages a run goes
through. Each part imports only the parts below it (its docstring's ``May import:`` line;
``tests/test_layering.py`` checks):

    commands/     the ``ctr`` command and its subcommands, each a thin entry point
    training/     a training run composed (run.py), its LightningModule, callbacks, trainer, publishing,
                  init-from and the daily driver
    tracking/     MLflow: the store, the queued logger, sweeps, the pyfunc model
    config.py     the run's typed configuration, parsed and checked once
    serving/      model folders, the one weight reader and writer, row encoding, scoring, prediction, export
    checkpoint/   sharded DCP checkpoints: writing, reading, integrity, discovery, resume
    data/         raw readers, preprocessing passes, vocabularies, the columnar store, batches
    runtime/      process plumbing: ranks, signals, user errors, the Hydra job, process exit
"""
