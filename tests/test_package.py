"""The package as a user installs it: a wheel (not the checkout) with its configs inside, one ``ctr``
command for everything, ``--help`` on each, run from a folder that is not the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pandas as pd
import pytest
import tomllib

from pipeline.commands.ctr import COMMANDS
from tests.conftest import PYTHON, ROOT, one_at_a_time

# one worker builds the wheel for all of them (make test: --dist loadfile): two builds at once from the checkout
# share its build/ folder, and one of them came out without the pipeline package or failed copying from it. The
# builds also take a lock the workers share (below), whatever the distribution.
pytestmark = pytest.mark.xdist_group("wheel")


def test_every_package_of_the_checkout_is_in_the_wheel_list():
    """``pyproject.toml`` lists the packages explicitly (``conf/`` is mapped to ``ctr_conf``): a new
    subpackage left out of the list would be missing from the wheel, and a config folder left out makes setuptools
    warn at every install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("pipeline", "modules")
             for p in (ROOT / top).rglob("__init__.py")}
    configs = {".".join(("ctr_conf", *p.parent.relative_to(ROOT / "conf").parts))
               for p in [*(ROOT / "conf").rglob("__init__.py"), *(ROOT / "conf").rglob("*.yaml")]}
    assert found | configs == listed, (found, listed)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh virtual environment with the project's wheel installed; its third-party dependencies
    are those of the test's own environment (a path entry, as from a local cache), so only the
    project's own files come from the wheel. Returns (its bin folder, a clean environment)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # the workers' temporary folders share a parent: one build from the checkout at a time
    with one_at_a_time(tmp_path_factory, "wheel-build"):
        subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("ctr_pipeline-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    # the dependencies: this environment's site-packages as a plain path entry (its .pth files, among
    # them the checkout's editable finder, are not processed from there)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([PYTHON, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                             "LOCAL_WORLD_SIZE", "CTR_CACHE_DIR", "MLFLOW_TRACKING_URI")}
    return venv / "bin", {**env, "OMP_NUM_THREADS": "1"}


def ctr(installed: tuple[Path, dict[str, str]], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    bin_dir, env = installed
    proc = subprocess.run([str(bin_dir / "ctr"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"ctr {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_the_wheel_trains_predicts_and_exports_from_any_folder(installed, tmp_path):
    bin_dir, _ = installed
    where = ctr(installed, tmp_path, "predict", "--cfg", "job")  # composes from the installed package
    assert (bin_dir.parent / "lib").exists() and "checkpoint: ???" in where.stdout
    imported = subprocess.run([str(bin_dir / "python"), "-c", "import pipeline, ctr_conf; print(pipeline.__file__, "
                               "ctr_conf.__file__)"], cwd=tmp_path, env=installed[1], capture_output=True, text=True)
    assert str(ROOT) not in imported.stdout and str(bin_dir.parent) in imported.stdout, imported.stdout
    native = subprocess.run([str(bin_dir / "python"), "-c", "from modules.embedding.ssd_tier import native_loops as n; "
                             "from modules.embedding import native_build as b, row_init as r; "
                             "r.normal_rows(0, 0, [1], 4, 1.0); "  # row_init.c ships and builds too
                             "print(n.SOURCE, n.available() and r.native(), b.library_path(n.SOURCE))"],
                            cwd=tmp_path, env={**installed[1], "XDG_CACHE_HOME": str(tmp_path / "xdg")},
                            capture_output=True, text=True)
    source, built, library = native.stdout.split()  # the row cache's C source ships in the wheel and builds
    assert source.startswith(str(bin_dir.parent)) and built == "True" and Path(library).is_relative_to(tmp_path), native
    # a user's own config folder composes on top of the packaged configs
    (tmp_path / "myconf" / "experiment").mkdir(parents=True)
    (tmp_path / "myconf" / "experiment" / "tiny.yaml").write_text(
        "# @package _global_\ndata:\n  synthetic: {rows: 30000}\nmodel: {mlp: [32], embedding_dim: 8}\n"
        "trainer: {batch_size: 1024, eval_batch_size: 4096, max_epochs: 1, enable_progress_bar: false}\n")
    trained = ctr(installed, tmp_path, "train", "--config-dir", str(tmp_path / "myconf"), "+experiment=tiny",
                  "trainer.checkpoint.dir=ckpt", "hydra.run.dir=run")
    assert "RESULT test_auc=" in trained.stdout
    assert (tmp_path / ".cache" / "data").is_dir() and (tmp_path / "mlflow.db").is_file()  # relative to the cwd
    (raw,) = (tmp_path / ".cache" / "data" / "raw").glob("synthetic-*.tsv")
    pd.read_csv(raw, sep="\t", header=None, nrows=2000).to_csv(tmp_path / "rows.tsv", sep="\t", header=False,
                                                               index=False)
    for checkpoint in ("ckpt", "run/model"):  # a run's checkpoint folder (its newest checkpoint), its model folder
        out = tmp_path / f"{checkpoint.replace('/', '_')}.parquet"
        scored = ctr(installed, tmp_path, "predict", f"checkpoint={checkpoint}", "input=rows.tsv", f"output={out}")
        assert "Wrote 2000 predictions" in scored.stdout
    exported = ctr(installed, tmp_path, "export", "checkpoint=ckpt", "out=exported")
    assert (tmp_path / "exported" / "model.json").is_file(), exported.stdout
    ctr(installed, tmp_path, "predict", "checkpoint=exported", "input=rows.tsv", "output=exported.parquet")
    probabilities = {name: pd.read_parquet(tmp_path / f"{name}.parquet")["probability"].to_numpy()
                     for name in ("ckpt", "run_model", "exported")}
    assert (probabilities["ckpt"] == probabilities["exported"]).all()
    assert abs(probabilities["ckpt"] - probabilities["run_model"]).max() < 1e-6
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("predict*"))


HELP_SHOWS = {"train": "trainer.batch_size=4096", "daily": "trainer.init_from=None", "plan": "topology.ddr_cap_gb=16",
              "predict": "checkpoint: ???", "export": "out: ???", "report": "experiment_name: batch_scaling",
              "sync": "source: null",
              "serve": "max_batch_rows: 4096"}


def test_every_command_has_help_with_its_keys_and_defaults(installed, tmp_path):
    """Every command's ``--help``, started all at once (each start imports torch: ~6 s), checked one by one."""
    bin_dir, env = installed
    procs = {}
    for command in sorted(COMMANDS):
        (tmp_path / command).mkdir()
        procs[command] = subprocess.Popen([str(bin_dir / "ctr"), command, "--help"], cwd=tmp_path / command, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for command, proc in procs.items():
        shown, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"ctr {command} --help:\n{shown[-2000:]}\n{err[-4000:]}"
        assert HELP_SHOWS[command] in shown, f"ctr {command} --help:\n{shown[-3000:]}"
        if command == "train":  # the groups and common keys, not 800 lines of per-feature defaults (--cfg job)
            assert len(shown.splitlines()) < 60 and "model: dcn, dcnv2, deepfm, wide_deep" in shown
            assert "+topology.table_overrides" in shown and "ctr train --cfg job" in shown
        assert not (tmp_path / command / "outputs").exists(), command  # --help writes nothing


def test_ctr_lists_its_commands(installed, tmp_path):
    assert all(name in ctr(installed, tmp_path, "--help").stdout for name in COMMANDS)
