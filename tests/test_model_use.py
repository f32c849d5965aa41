"""Using a trained model: batch prediction from raw files, the MLflow pyfunc model (loaded and served by a
real ``mlflow models serve``), and export of a 2-process checkpoint to one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline.data.pass1 import assign_splits
from pipeline.data.preprocess_config import SplitConfig
from tests.conftest import PYTHON, ROOT, free_port, subprocess_env, train_cli


def command(module: str, *args: str, launcher: list[str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([PYTHON, *(launcher or []), "-m", module, *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def predict_here(checkpoint: Path, input: Path, output: Path) -> np.ndarray:
    """``pipeline.commands.predict`` in this process (one process: no process group)."""
    from pipeline.scoring.prediction import PredictArgs, run

    run(PredictArgs(checkpoint=str(checkpoint), input=str(input), output=str(output)))
    return pd.read_parquet(output)["probability"].to_numpy() if output.suffix == ".parquet" else \
        pd.read_csv(output)["probability"].to_numpy()


@pytest.fixture(scope="module")
def trained(own_data_run):
    """The run on a generated log (1 process, conftest), and the raw rows of its own test split, in file order."""
    folder, conf, args, result, frame, _ = own_data_run
    split = assign_splits(np.arange(len(frame), dtype=np.uint64), len(frame), SplitConfig(valid=0.1, test=0.2, seed=0))
    test_rows = frame[split == 2]
    test_rows.to_csv(folder / "test.csv", index=False)
    return folder, conf, args, result, test_rows


def test_predict_on_the_runs_own_test_rows_gives_its_test_auc(trained):
    folder, _, _, result, test_rows = trained
    out = folder / "pred.parquet"
    proc = command("pipeline.commands.predict", f"checkpoint={folder / 'run' / 'model'}", f"input={folder / 'test.csv'}",
                   f"output={out}")
    written = pd.read_parquet(out)
    assert len(written) == len(test_rows) and (written["label"].to_numpy() == test_rows["clicked"].to_numpy()).all()
    import torch
    from torchmetrics.functional.classification import binary_auroc

    auc = float(binary_auroc(torch.tensor(written["probability"].to_numpy()),
                             torch.from_numpy(written["label"].to_numpy().astype(np.int64))))
    assert abs(auc - result.test_auc) <= 1e-6, (auc, result.test_auc)
    assert f"AUC {auc:.6f}" in proc.stdout
    # unseen ids, missing values, no label column: scored, one row each, in order
    odd = test_rows.head(4).drop(columns=["clicked"]).copy()
    odd.loc[odd.index[0], "user_id"] = "never-seen"
    odd.loc[odd.index[1], "tags"] = None
    odd.loc[odd.index[2], "price"] = None
    odd.loc[odd.index[3], "tags"] = "brand-new|t1"
    odd.to_csv(folder / "odd.csv", index=False)
    scores = predict_here(folder / "run" / "model", folder / "odd.csv", folder / "odd.out.csv")
    assert list(pd.read_csv(folder / "odd.out.csv").columns) == ["probability"] and len(scores) == 4
    assert ((scores > 0) & (scores < 1)).all()


def test_pyfunc_model_and_mlflow_models_serve_match_predict(trained):
    import mlflow

    folder, _, _, result, test_rows = trained
    rows = test_rows.head(50).drop(columns=["clicked"]).reset_index(drop=True)
    rows.to_csv(folder / "few.csv", index=False)
    want = predict_here(folder / "run" / "model", folder / "few.csv", folder / "few.parquet")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"runs:/{result.mlflow_run_id}/model")
    np.testing.assert_allclose(model.predict(rows)["probability"].to_numpy(), want, atol=1e-6)
    # the run registered it (logger.register_model_as=mylog_ctr): version 1 is this run's model
    assert mlflow.MlflowClient(uri).get_model_version("mylog_ctr", "1").run_id == result.mlflow_run_id
    registered = mlflow.pyfunc.load_model("models:/mylog_ctr/1")
    np.testing.assert_allclose(registered.predict(rows)["probability"].to_numpy(), want, atol=1e-6)
    # the MLflow model's folder shares the model folder's files (hard links): the tables are on disk once there
    staged = sorted((folder / "run" / "mlflow_model" / "artifacts" / "model" / "tables").iterdir())
    assert staged and all(f.stat().st_ino == (folder / "run" / "model" / "tables" / f.name).stat().st_ino
                          for f in staged), staged

    port = free_port()
    server = subprocess.Popen([str(Path(PYTHON).parent / "mlflow"), "models", "serve", "-m",
                               f"runs:/{result.mlflow_run_id}/model", "--env-manager", "local", "-h", "127.0.0.1",
                               "-p", str(port)], cwd=folder,
                              env=subprocess_env(MLFLOW_TRACKING_URI=uri,  # it starts `uvicorn` from the PATH
                                                 PATH=f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.time() < deadline, server.stderr.read().decode()[-3000:]
                time.sleep(0.5)
        body = json.dumps({"dataframe_split": json.loads(rows.to_json(orient="split", index=False))}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            served = json.loads(response.read())["predictions"]
        # numbers sent as strings where the declaration says numeric: the same predictions
        as_text = rows.assign(price=rows["price"].map(lambda v: None if pd.isna(v) else repr(float(v))))
        assert post(port, as_text)[0] == 200
        np.testing.assert_allclose([p["probability"] for p in post(port, as_text)[1]["predictions"]], want, atol=1e-6)
        # a missing column, a word in a numeric column: HTTP 400 naming the column
        status, answer = post(port, rows.drop(columns=["tags"]))
        assert status == 400 and "tags" in answer["message"], answer
        status, answer = post(port, rows.assign(price=["cheap"] * len(rows)))
        assert status == 400 and "column 'price', row 0: 'cheap' is not a number" in answer["message"], answer
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        server.stderr.close()
    np.testing.assert_allclose([p["probability"] for p in served], want, atol=1e-6)


def post(port: int, frame: pd.DataFrame) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of ``POST /invocations`` with ``frame`` as ``dataframe_split``."""
    body = json.dumps({"dataframe_split": json.loads(frame.to_json(orient="split", index=False))}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_quantized_tables_score_like_float_at_a_fraction_of_the_size(trained, tmp_path):
    """``ctr export quantize=int8|int4|fp16`` of the run's model: predict and the pyfunc model score the run's
    test rows within each format's tolerance of float, the test AUC moves by at most 0.0005 (int8), the
    table files shrink as row_bytes says; the MLflow model's signature names every raw column."""
    import mlflow
    import torch
    from torchmetrics.functional.classification import binary_auroc

    from pipeline.model_folder.export import export_model
    from pipeline.model_folder.quantize import row_bytes
    from pipeline.tracking.pyfunc import save_pyfunc

    folder, _, _, _, test_rows = trained
    model = folder / "run" / "model"
    labels = torch.from_numpy(test_rows["clicked"].to_numpy().astype(np.int64))
    floats = predict_here(model, folder / "test.csv", tmp_path / "float.parquet")
    auc = float(binary_auroc(torch.tensor(floats), labels))
    description = json.loads((model / "model.json").read_text())
    float_bytes = sum((model / "tables" / f"{k}.f32").stat().st_size for k in description["tables"])
    for q, tolerance in (("int8", 2e-3), ("int4", 3e-2), ("fp16", 2e-4)):
        out = tmp_path / f"model_{q}"
        export_model(model, out, q)  # (the command's own path: tests/test_package.py, tests/test_ssd_tier.py)
        sizes = {k: (out / "tables" / f"{k}.u8").stat().st_size for k in description["tables"]}
        assert sizes == {k: rows * row_bytes(dim, q) for k, (rows, dim) in description["tables"].items()}
        assert sum(sizes.values()) <= float_bytes / 2
        scores = predict_here(out, folder / "test.csv", tmp_path / f"{q}.parquet")
        np.testing.assert_allclose(scores, floats, atol=tolerance)
        if q == "int8":
            assert abs(float(binary_auroc(torch.tensor(scores), labels)) - auc) <= 5e-4
            rows = test_rows.head(50).drop(columns=["clicked"]).reset_index(drop=True)
            pyfunc = mlflow.pyfunc.load_model(str(save_pyfunc(out, rows.head(5), tmp_path / "pyfunc_int8")))
            np.testing.assert_allclose(pyfunc.predict(rows)["probability"].to_numpy(), scores[:50], atol=1e-6)
            inputs = pyfunc.metadata.get_input_schema().inputs
            assert sorted(c.name for c in inputs) == sorted(rows.columns) and all(c.required for c in inputs)
            # logger.model_signature=false: MLflow checks nothing, the model's own checks name the column
            bare = mlflow.pyfunc.load_model(str(save_pyfunc(out, rows.head(5), tmp_path / "bare", signature=False)))
            assert bare.metadata.get_input_schema() is None
            with pytest.raises(mlflow.exceptions.MlflowException, match="input lacks column 'tags'"):
                bare.predict(rows.drop(columns=["tags"]))


def test_fp16_tables_train_checkpoint_and_score_at_half_the_bytes(trained, tmp_path):
    """``model.table_precision=fp16``: the same run with fp16 rows. Its checkpoint holds fp16 tables; its model folder
    keeps them as fp16 rows (2 bytes a value: half the float folder's table bytes), which ``ctr predict`` scores to
    the run's own test AUC, as does the checkpoint (read into float32, exactly); an int8 export of the fp16 folder
    scores as one of the checkpoint; the AUC is within 0.001 of the fp32 run's on this small log (3e-6 measured here;
    docs/throughput.md has the difference on 2M rows)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torchmetrics.functional.classification import binary_auroc

    from pipeline.model_folder.export import export_model
    from pipeline.runtime.errors import BundleError
    from pipeline.scoring.scorer import Scorer

    folder, _, args, result32, test_rows = trained
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    _, result = train_cli([*args, "model.table_precision=fp16", f"trainer.checkpoint.dir={ckpt}"], run)
    model = run / "model"
    description = json.loads((model / "model.json").read_text())
    assert description["quantize"] == "fp16" and description["model"]["table_precision"] == "fp16"
    sizes = {k: (model / "tables" / f"{k}.u8").stat().st_size for k in description["tables"]}
    assert sizes == {k: rows * dim * 2 for k, (rows, dim) in description["tables"].items()}
    float32_folder = folder / "run" / "model"
    assert 2 * sum(sizes.values()) == sum((float32_folder / "tables" / f"{k}.f32").stat().st_size
                                          for k in description["tables"])
    newest = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))[-1]
    saved = FileSystemReader(str(newest)).read_metadata().state_dict_metadata
    tables = {k: m.properties.dtype for k, m in saved.items() if ".embedding_bags." in k and k.endswith(".weight")}
    assert tables and set(tables.values()) == {torch.float16}, tables

    labels = torch.from_numpy(test_rows["clicked"].to_numpy().astype(np.int64))
    scores = predict_here(model, folder / "test.csv", tmp_path / "fp16.parquet")
    auc = float(binary_auroc(torch.tensor(scores), labels))
    assert abs(auc - result.test_auc) <= 1e-6, (auc, result.test_auc)
    np.testing.assert_allclose(predict_here(newest, folder / "test.csv", tmp_path / "ckpt.parquet"), scores, atol=1e-6)
    fused = Scorer(newest, table_dir=tmp_path / "tables", fused=True)  # the checkpoint as ctr serve scores it
    np.testing.assert_allclose(fused.score_frame(test_rows.drop(columns=["clicked"])), scores, atol=1e-6)
    export_model(model, tmp_path / "int8", "int8")
    export_model(newest, tmp_path / "int8_ckpt", "int8")
    np.testing.assert_allclose(predict_here(tmp_path / "int8", folder / "test.csv", tmp_path / "a.parquet"),
                               predict_here(tmp_path / "int8_ckpt", folder / "test.csv", tmp_path / "b.parquet"),
                               atol=1e-6)
    assert abs(result.test_auc - result32.test_auc) <= 1e-3, (result.test_auc, result32.test_auc)
    # result.json (and MLflow's model/table_*bytes): the weights at 2 bytes a value, the row-wise state still 4
    assert 2 * result.table_weight_bytes == result32.table_weight_bytes == sum(4 * r * d for r, d in description["tables"].values())
    rows = sum(r for r, _ in description["tables"].values())
    assert result.table_bytes - result.table_weight_bytes == result32.table_bytes - result32.table_weight_bytes == 4 * rows
    # an int8 folder is not the trained rows: training from it, or exporting it again, is refused by name
    with pytest.raises(BundleError, match="its tables are int8 rows"):
        export_model(tmp_path / "int8", tmp_path / "again")
    assert not (tmp_path / "again").exists()


@pytest.mark.slow  # the 2-rank path (train, export, 2 ranks scoring a checkpoint = one process scoring its export) runs in
# CI in test_zch's 2-rank kill-and-resume test and test_checkpointing's 2-rank ssd test; this adds the vocabulary encoder
def test_two_process_checkpoint_exports_and_predicts_in_one_process(trained, tmp_path):
    folder, _, args, _, _ = trained
    ckpt = tmp_path / "ckpt"
    train_cli([*args, f"trainer.checkpoint.dir={ckpt}", "trainer.max_epochs=1"], tmp_path / "run2",
              launcher=["-m", "torch.distributed.run", "--nproc_per_node=2"])
    (last,) = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))[-1:]
    command("pipeline.commands.export", f"checkpoint={ckpt}", f"out={tmp_path / 'export'}")  # the folder: its newest
    test_csv = folder / "test.csv"
    outputs = {"run_model": predict_here(tmp_path / "run2" / "model", test_csv, tmp_path / "run_model.parquet"),
               "checkpoint": predict_here(last, test_csv, tmp_path / "checkpoint.parquet")}
    for name, source, launcher in (("export", tmp_path / "export", None),  # a fresh process
                                   ("sharded", ckpt, ["-m", "torch.distributed.run", "--nproc_per_node=2"])):
        out = tmp_path / f"{name}.parquet"
        command("pipeline.commands.predict", f"checkpoint={source}", f"input={test_csv}", f"output={out}", launcher=launcher)
        outputs[name] = pd.read_parquet(out)["probability"].to_numpy()
    # the export, the run's own model folder and the checkpoint read in one process: the same bits
    assert (outputs["export"] == outputs["run_model"]).all() and (outputs["export"] == outputs["checkpoint"]).all()
    # two ranks scoring their shares through the sharded tables: the same numbers to float rounding
    np.testing.assert_allclose(outputs["sharded"], outputs["export"], atol=1e-6)


def test_errors_name_the_cause_and_write_nothing(trained, tmp_path):
    folder, _, _, _, test_rows = trained
    test_rows.drop(columns=["tags"]).to_csv(tmp_path / "no_tags.csv", index=False)
    out = tmp_path / "out.parquet"
    proc = command("pipeline.commands.predict", f"checkpoint={folder / 'run' / 'model'}", f"input={tmp_path / 'no_tags.csv'}",
                   f"output={out}", check=False)
    assert proc.returncode == 2 and "the header lacks column 'tags' (declared in data=mylog)" in proc.stderr
    assert not out.exists() and not list(tmp_path.glob("out.parquet.tmp-*"))
    damaged = tmp_path / "model"
    import shutil

    from pipeline.runtime.errors import BadInputError, BundleError

    shutil.copytree(folder / "run" / "model", damaged)
    vocab = damaged / "vocab" / "user_id.parquet"
    vocab.write_bytes(vocab.read_bytes()[:100])
    with pytest.raises(BundleError, match=f"{vocab}: cannot read the vocabulary of table 'user_id'"):
        predict_here(damaged, folder / "test.csv", out)
    criteo = ROOT.parent / "shared" / "data" / "criteo_sample" / "dac_sample.tsv"
    if criteo.exists():  # a file of another dataset's layout
        with pytest.raises(BadInputError, match="the header lacks column"):
            predict_here(folder / "run" / "model", criteo, out)
    assert not out.exists() and not list(tmp_path.glob("out.parquet.tmp-*"))


def test_predict_refuses_a_collective_timeout_it_cannot_honour():
    from omegaconf import OmegaConf

    from pipeline.config import ConfigError, to_typed
    from pipeline.scoring.prediction import PredictArgs

    given = {"checkpoint": "m", "input": "i.csv", "output": "o.csv", "collective_timeout_s": 0}
    with pytest.raises(ConfigError, match=r"collective_timeout_s=0.*expected seconds > 0"):
        to_typed(OmegaConf.merge(OmegaConf.structured(PredictArgs), given))
