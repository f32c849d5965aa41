"""Which model the server answers with: a model spec made a local model folder once, the newest version
of what ``serve.watch`` names, and the hand-over from the process that watches to the workers.

    model=<model folder>                      served from its files (mapped: one copy for all workers)
    model=<checkpoint | folder of checkpoints>  exported once to a model folder in the serve directory
    model=runs:/<run id>/model | models:/<name>/<version> | models:/<name>/latest   downloaded once

    serve.watch=models:/<name>   (or <name>)  the registered model's highest version
    serve.watch=<folder>                      the newest model folder in it — <folder>, <folder>/*,
                                              <folder>/*/model (``ctr daily``'s day_N/model) — by the time
                                              its model.json was written (folders are published by rename)

The watching process writes the version to answer with to ``<serve dir>/current.json`` (temporary name,
then rename); each worker polls that file and loads a new version beside the one it serves, switching
when it is ready (:mod:`.app`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.checkpoint.discovery import checked_checkpoint
from pipeline.runtime.errors import BundleError
from pipeline.model_folder.export import export_model
from pipeline.model_folder.source import is_model_folder

CURRENT = "current.json"


@dataclass(frozen=True)
class Version:
    label: str   # what /version and the X-Model-Version header say
    folder: str  # the local model folder


def prepare(spec: str, workdir: Path) -> Version:
    """The local model folder of ``spec`` (downloading or exporting it into ``workdir`` the first time)."""
    if spec.startswith(("runs:/", "models:/")):
        spec = _pinned(spec)
        target = workdir / ("mlflow-" + slug(spec))
        if not target.is_dir():
            import mlflow

            tmp = workdir / f".download-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                mlflow.artifacts.download_artifacts(artifact_uri=spec, dst_path=str(tmp))
            except Exception as e:  # noqa: BLE001 — MLflow raises many kinds; the message names the cause
                shutil.rmtree(tmp, ignore_errors=True)
                raise BundleError(f"model={spec}: cannot download it ({' '.join(str(e).split())[:300]})") from None
            os.rename(tmp, target)
        found = sorted(target.rglob("model.json"))
        if not found:
            raise BundleError(f"model={spec}: no model folder (model.json) in the downloaded model; is it a "
                              f"model logged by a ctr run?")
        return Version(spec, str(found[0].parent))
    path = Path(spec).expanduser()
    if is_model_folder(path):
        return Version(str(path.resolve()), str(path.resolve()))
    if not path.exists():
        raise FileNotFoundError(f"model={spec}: no such model folder, checkpoint or MLflow model")
    checkpoint = checked_checkpoint(path)
    out = workdir / ("checkpoint-" + slug(str(checkpoint.resolve())))
    if not is_model_folder(out):
        export_model(checkpoint, out)
    return Version(str(checkpoint.resolve()), str(out))


def newest(watch: str) -> str | None:
    """The newest model spec of what ``serve.watch`` names, None while there is none."""
    path = Path(watch).expanduser()
    if watch.startswith("models:/") or not path.exists():
        from mlflow import MlflowClient

        name = watch.removeprefix("models:/").strip("/")
        versions = [int(v.version) for v in MlflowClient().search_model_versions(f"name='{name}'")]
        return f"models:/{name}/{max(versions)}" if versions else None
    found = [p for pattern in ("model.json", "*/model.json", "*/model/model.json") for p in path.glob(pattern)]
    return str(max(found, key=lambda p: p.stat().st_mtime).parent) if found else None


def publish(version: Version, workdir: Path) -> None:
    """Tell the workers to answer with ``version``."""
    tmp = workdir / f".{CURRENT}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(version)))
    os.replace(tmp, workdir / CURRENT)


def published(workdir: Path) -> tuple[Version, int]:
    """The version to answer with and the file's change time (ns) to poll against."""
    path = workdir / CURRENT
    stamp = path.stat().st_mtime_ns
    return Version(**json.loads(path.read_text())), stamp


def _pinned(spec: str) -> str:
    """``models:/name/latest`` (or ``models:/name``) → ``models:/name/<highest version>``."""
    if not spec.startswith("models:/"):
        return spec
    parts = spec.removeprefix("models:/").strip("/").split("/")
    if len(parts) == 2 and parts[1] != "latest":
        return spec
    pinned = newest(f"models:/{parts[0]}")
    if pinned is None:
        raise BundleError(f"model={spec}: the registered model {parts[0]!r} has no version")
    return pinned


def slug(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
