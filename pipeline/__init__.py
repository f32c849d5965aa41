"""The training pipeline around :mod:`modules` (the models and the algorithms), by the stages a run goes
through. Each part imports only the parts below it (its docstring's ``May import:`` line;
``tests/test_layering.py`` checks):

    commands/     the ``ctr`` command and its subcommands, each a thin entry point
    training/     a training run composed (run.py), its LightningModule, callbacks, trainer, publishing,
                  init-from and the daily driver
    server/       ``ctr serve``: the HTTP scoring server (admission, micro-batches, model versions)
    tracking/     MLflow: the store, the queued logger, sweeps, the pyfunc model
    scoring/      raw rows encoded as in training and scored by a trained model; batch prediction
    config.py     the run's typed configuration, parsed and checked once
    model_folder/ a trained model on disk: the folder's layout, the one weight and table reader and writer,
                  quantized rows, a folder or checkpoint as a source, export
    checkpoint/   sharded DCP checkpoints: writing, reading, integrity, discovery, resume
    data/         raw readers, preprocessing passes, vocabularies, the columnar store, batches
    runtime/      process plumbing: ranks, signals, user errors, the Hydra job, process exit
"""
