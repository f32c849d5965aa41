"""The ``ctr`` command (:mod:`.ctr`) and one module per subcommand — train, daily, predict, export, plan,
report, sync, serve — each a thin entry point: compose the config, call one function below, print the outcome.

May import: training, tracking, config, server, scoring, model_folder, checkpoint, data, runtime, modules
"""

from pipeline.runtime.library_noise import quiet_libraries

quiet_libraries()
