"""MLflow: which store a run logs to (:mod:`.store`), the logger whose calls never block training
(:mod:`.logger`) and its settings (:mod:`.logger_config`), sweeps as parent and child runs (:mod:`.sweeps`), the
pyfunc model (:mod:`.pyfunc`).

May import: scoring, model_folder, data, runtime
"""
