"""A training run: :func:`.run.train` composes it (parse → data → model and task → trainer → fit and
test → publish); the LightningModule (:mod:`.task`), its callbacks (:mod:`.callbacks`), the trainer
(:mod:`.trainer`), best-validation and non-finite policies, the TorchRec strategy, starting from an
earlier model (:mod:`.init_from`), what a run leaves behind (:mod:`.publish`) and the day-by-day driver
(:mod:`.daily`).

May import: tracking, config, scoring, model_folder, checkpoint, data, runtime, modules
"""
