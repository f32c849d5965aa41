"""MLflow: which store a run logs to (:mod:`.store`), the logger whose calls never block training
(:mod:`.logger`), sweeps as parent and child runs (:mod:`.sweeps`), the pyfunc model (:mod:`.pyfunc`).

May import: config, serving, data, runtime
"""
