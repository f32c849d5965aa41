"""The MLflow model of a run: a pyfunc model over the run's model folder (:mod:`pipeline.model_folder.layout`).

    mlflow.pyfunc.load_model("runs:/<id>/model").predict(pandas_df_of_raw_columns)  → DataFrame ``probability``
    mlflow models serve -m runs:/<id>/model --env-manager local                      → POST /invocations

The model carries the bundle (unsharded weights, vocabularies, transforms, declaration; its tables
float32 or quantized, ``logger.quantize``) as an artifact, this project's ``pipeline`` and ``modules``
packages as code, a signature from the dataset declaration (:func:`raw_signature`; every raw column,
its kind in the metadata ``ctr_columns``), an input example (the first raw rows) and the installed
versions of what scoring imports as pinned requirements. Built on the CPU of any machine: no process
group, no GPU. A serving process loads the model once, scores through FBGEMM's fused inference kernels
with ``CTR_SERVING_THREADS`` intra-op threads (default 1: run one worker per core), and answers a
missing or unreadable column with HTTP 400 naming it.
"""

from __future__ import annotations

import logging
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types.schema import AnyType, ColSpec, DataType, Schema

import modules
import pipeline
from pipeline.data.dataset import DataConfig
from pipeline.runtime.errors import BundleError, MissingColumnsError
from pipeline.runtime.library_noise import quiet_libraries
from pipeline.scoring.scorer import Scorer
from pipeline.model_folder.source import model_source

log = logging.getLogger(__name__)
CODE = [Path(package.__file__).resolve().parent for package in (pipeline, modules)]  # the model's code_paths
THREADS_ENV = "CTR_SERVING_THREADS"  # intra-op threads of a serving process (default 1: one request per core)
REQUIREMENTS = ("torch", "torchrec", "fbgemm-gpu", "fbgemm_gpu-cpu", "numpy", "pandas", "pyarrow", "omegaconf",
                "tqdm", "mlflow")


class CTRModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: raw rows in, click probabilities out. The model, vocabularies and thread count are
    set once per process (``load_context``); a request only encodes its rows and runs the model."""

    def load_context(self, context: Any) -> None:
        quiet_libraries()  # in MLflow's scoring server: not through a ctr command
        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        self.scorer = Scorer(context.artifacts["bundle"], fused=True)

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        try:
            probability = self.scorer.score_frame(frame)
        except (BundleError, MissingColumnsError) as e:  # a column missing or unreadable: HTTP 400 naming it
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None
        return pd.DataFrame({"probability": probability})


def raw_signature(data: DataConfig) -> ModelSignature:
    """The model's input: every raw column the declaration reads, each required. Categorical columns are
    strings (as in the raw file); numeric columns numbers or strings of numbers (the scorer checks them
    and names a bad one); sequences and time columns for derived features either form. Values may be
    null: a missing value, as in training."""
    text = {f.source for f in data.declared() if f.type == "categorical" and not f.derive}
    inputs = [ColSpec(DataType.string if c in text else AnyType(), c) for c in data.read_columns if c != data.label]
    return ModelSignature(Schema(inputs), Schema([ColSpec(DataType.float, "probability")]))


def column_types(data: DataConfig) -> dict[str, str]:
    """Each raw column's declared kind (the MLflow model's metadata ``ctr_columns``)."""
    kinds = {f.source: ("time" if f.derive else f.type) for f in data.declared()}
    return {c: kinds[c] for c in data.read_columns if c != data.label}


def pinned_requirements() -> list[str]:
    out = []
    for name in REQUIREMENTS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return out


def save_pyfunc(bundle: Path, example: pd.DataFrame, out: Path, signature: bool = True) -> Path:
    """Write the MLflow model folder of ``bundle`` at ``out`` (replacing it). Without ``signature`` (and then
    without the input example, from which MLflow would infer one) MLflow checks no column itself; the
    scorer's own checks still answer a missing or unreadable column with a 400 naming it."""
    data = model_source(bundle).data  # the signature and column kinds leave out its label
    example = example.head(5).reset_index(drop=True)
    shutil.rmtree(out, ignore_errors=True)
    threads = torch.get_num_threads()  # MLflow may load the model here to check the example
    try:
        mlflow.pyfunc.save_model(str(out), python_model=CTRModel(), artifacts={"bundle": str(bundle)},
                                 code_paths=[str(p) for p in CODE],
                                 signature=raw_signature(data) if signature else None,
                                 input_example=example if signature else None,  # else MLflow infers a signature
                                 pip_requirements=pinned_requirements(), metadata={"ctr_columns": column_types(data)})
    finally:
        torch.set_num_threads(threads)
    _link_to(out / "artifacts" / bundle.name, bundle)
    return out


def _link_to(copy: Path, source: Path) -> None:
    """MLflow copied the model folder ``source`` to ``copy``: each copied file becomes a hard link to its source,
    so the tables (most of a model's bytes) are on disk once, not twice; where the file system cannot link, the
    copy stays. (The model folder is written whole into a new folder and renamed, never in place, so a link
    cannot see a later run's bytes.)"""
    for file in list(copy.rglob("*")):  # listed first: the loop adds and renames entries
        original = source / file.relative_to(copy)
        if file.is_file() and original.is_file() and file.stat().st_size == original.stat().st_size:
            staged = file.with_name(f".{file.name}.link")
            try:
                os.link(original, staged)
                os.replace(staged, file)
            except OSError:
                staged.unlink(missing_ok=True)


def log_pyfunc(client: Any, run_id: str, bundle: Path, example: pd.DataFrame, folder: Path,
               signature: bool = True) -> None:
    """Save the pyfunc model at ``folder`` (kept: the logging call may be queued) and log it as the run's
    artifact ``model``."""
    client.log_artifacts(run_id, str(save_pyfunc(bundle, example, folder, signature)), "model")


def register(tracking_uri: str, run_id: str, name: str) -> str:
    """Register the run's model in the Model Registry under ``name``; returns the version."""
    mlflow.set_tracking_uri(tracking_uri)
    return str(mlflow.register_model(f"runs:/{run_id}/model", name).version)
