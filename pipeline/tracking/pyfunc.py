"""The MLflow model of a run: a pyfunc model over the run's model folder (:mod:`pipeline.serving.model_folder`).

    mlflow.pyfunc.load_model("runs:/<id>/model").predict(pandas_df_of_raw_columns)  → DataFrame ``probability``
    mlflow models serve -m runs:/<id>/model --env-manager local                      → POST /invocations

The model carries the bundle (unsharded weights, vocabularies, transforms, declaration) as an
artifact, this project's ``pipeline`` and ``modules`` packages as code, a signature over the raw
columns, an input example (the first raw rows) and the installed versions of what scoring imports
as pinned requirements. Built on the CPU of any machine: no process group, no GPU.
"""

from __future__ import annotations

import logging
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd

import modules
import pipeline
from pipeline.serving.scorer import Scorer

log = logging.getLogger(__name__)
CODE = [Path(package.__file__).resolve().parent for package in (pipeline, modules)]  # the model's code_paths
REQUIREMENTS = ("torch", "torchrec", "fbgemm-gpu", "fbgemm_gpu-cpu", "numpy", "pandas", "pyarrow", "omegaconf",
                "tqdm", "mlflow")


class CTRModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: raw rows in, click probabilities out."""

    def load_context(self, context: Any) -> None:
        self.scorer = Scorer(context.artifacts["bundle"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        return pd.DataFrame({"probability": self.scorer.score_frame(pd.DataFrame(model_input))})


def pinned_requirements() -> list[str]:
    out = []
    for name in REQUIREMENTS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return out


def save_pyfunc(bundle: Path, example: pd.DataFrame, out: Path) -> Path:
    """Write the MLflow model folder of ``bundle`` at ``out`` (replacing it)."""
    scorer = Scorer(bundle)
    example = example.head(5).reset_index(drop=True)
    output = pd.DataFrame({"probability": scorer.score_frame(example)})
    signature = mlflow.models.infer_signature(example, output)
    shutil.rmtree(out, ignore_errors=True)
    mlflow.pyfunc.save_model(str(out), python_model=CTRModel(), artifacts={"bundle": str(bundle)},
                             code_paths=[str(p) for p in CODE], signature=signature,
                             input_example=example, pip_requirements=pinned_requirements())
    return out


def log_pyfunc(client: Any, run_id: str, bundle: Path, example: pd.DataFrame, folder: Path) -> None:
    """Save the pyfunc model at ``folder`` (kept: the logging call may be queued) and log it as the run's
    artifact ``model``."""
    client.log_artifacts(run_id, str(save_pyfunc(bundle, example, folder)), "model")


def register(tracking_uri: str, run_id: str, name: str) -> str:
    """Register the run's model in the Model Registry under ``name``; returns the version."""
    mlflow.set_tracking_uri(tracking_uri)
    return str(mlflow.register_model(f"runs:/{run_id}/model", name).version)
