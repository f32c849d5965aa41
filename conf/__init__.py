"""The Hydra configs, installed as the package ``ctr_conf`` (``pyproject.toml`` maps it to this folder):
every command composes from ``pkg://ctr_conf``, so an installed wheel runs from any folder."""
