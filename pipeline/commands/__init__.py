"""The ``ctr`` command (:mod:`.ctr`) and one module per subcommand — train, daily, predict, export, plan,
report, sync — each a thin entry point: compose the config, call one function below, print the outcome.

May import: training, tracking, config, serving, checkpoint, data, runtime, modules
"""
