"""Batch prediction: raw rows in the dataset's own format → one click probability per row, in input order.

    ctr predict checkpoint=<model folder | checkpoint dir> input=<file, list, dir or glob> \
        output=<file.parquet | file.csv> [batch_size=65536]
    torchrun --nproc_per_node=2 -m pipeline.commands.predict checkpoint=<checkpoint dir> ...

``checkpoint`` is a model folder (a run's ``<output>/model``, or :mod:`pipeline.commands.export`'s), a sharded
checkpoint directory, or a folder of checkpoints (a run's ``trainer.checkpoint.dir``: its newest intact
one). The layout, vocabularies (unseen values → OOV, missing → the missing id; raw ids through the ``model.zch``
mapping, ids not held at training → the unknown row, their count printed),
numeric transforms and model come from it; the input rows are exactly like the training files, with
or without the label column. The input is read block by block (bounded memory, a progress bar);
the output has the column ``probability`` (and ``label`` when the input has one) and is written
under a temporary name, renamed when complete. With labels, the AUC and logloss of what was written
are printed.

Under ``torchrun`` (a checkpoint directory) the tables stay sharded as in training: every rank reads
the input, scores its contiguous share of each block through the sharded model (every rank runs the
same number of steps), and rank 0 gathers the probabilities and writes the one output file.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from omegaconf import MISSING
from torchmetrics.functional.classification import binary_auroc

from pipeline.data.dataset import DataConfig
from pipeline.data.features import extract
from pipeline.data.other_readers import open_reader
from pipeline.data.raw_files import first_fields
from pipeline.data.store import SplitArrays
from pipeline.runtime.errors import BundleError, MissingColumnsError
from pipeline.runtime.launch import world_from_env
from pipeline.scoring.row_encoder import RowEncoder
from pipeline.scoring.scorer import Scorer

OUTPUT_FORMATS = (".parquet", ".csv")


@dataclass
class PredictArgs:
    """``conf/predict.yaml``."""

    checkpoint: str = MISSING
    input: str = MISSING
    output: str = MISSING
    batch_size: int = 65536
    block_size: int = 32 << 20
    collective_timeout_s: float = 600.0  # under torchrun: how long a rank waits for the others before it stops

    def __post_init__(self) -> None:
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s}: expected seconds > 0")


@dataclass
class Prediction:
    rows: int
    auc: float | None
    logloss: float | None
    output: Path
    unseen: tuple[int, int] | None = None  # model.zch: (raw ids not held at training: the unknown row, raw ids)


def has_label(data: DataConfig, path: Path) -> bool:
    """Whether an input file holds the label column (header, Parquet schema, or field count)."""
    if data.format == "libsvm":
        return True
    if data.format == "parquet":
        return data.label in pq.ParquetFile(path).schema_arrow.names
    fields = first_fields(path, data.delimiter)
    if data.header:
        return data.label in fields
    if len(fields) == len(data.columns or ()):
        return True
    if len(fields) == len(data.columns or ()) - 1:
        return False
    raise MissingColumnsError(f"{path}:1: {len(fields)} columns; the model reads files of {len(data.columns or ())} "
                              f"columns {list(data.columns or ())} (or {len(data.columns or ()) - 1} without "
                              f"{data.label!r})")


class _Writer:
    """The output file, written under a temporary name and renamed by :meth:`commit`."""

    def __init__(self, output: Path, with_label: bool) -> None:
        if output.suffix not in OUTPUT_FORMATS:
            raise BundleError(f"output={output}: expected a file ending in {' or '.join(OUTPUT_FORMATS)}")
        output.parent.mkdir(parents=True, exist_ok=True)
        self.output, self.tmp = output, output.with_name(f"{output.name}.tmp-{os.getpid()}")
        fields = [("probability", pa.float32())] + ([("label", pa.int8())] if with_label else [])
        self.schema = pa.schema(fields)
        self.writer: Any = pq.ParquetWriter(self.tmp, self.schema) if output.suffix == ".parquet" \
            else pacsv.CSVWriter(str(self.tmp), self.schema)

    def write(self, probability: np.ndarray, label: np.ndarray | None) -> None:
        columns = [pa.array(probability, pa.float32())] + ([pa.array(label, pa.int8())] if label is not None else [])
        self.writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))

    def commit(self) -> None:
        self.writer.close()
        os.replace(self.tmp, self.output)

    def abort(self) -> None:
        self.writer.close()
        self.tmp.unlink(missing_ok=True)


def predict(model: RowEncoder, score: Callable[[SplitArrays], np.ndarray | None], inputs: list[Path], output: Path,
            block_size: int = 32 << 20, rank: int = 0) -> Prediction | None:
    """Score every row of ``inputs`` (each rank calls this; ``score`` returns the probabilities on rank 0)."""
    labels = {has_label(model.data, p) for p in inputs}
    if len(labels) > 1:
        raise MissingColumnsError(f"input: some files have the label column {model.data.label!r} and some do not")
    with_label = labels.pop()
    data = model.reading(with_label)
    writer = _Writer(output, with_label) if rank == 0 else None
    probs, truth, rows = [], [], 0  # probabilities and labels kept for the AUC only (labelled input)
    try:
        for path in inputs:
            reader = open_reader([path], data, block_size, "error", f"predict {path.name}")
            for table in reader:
                block = extract(table, data, reader.where, {})
                p = score(model.encode(block))
                if writer is not None:
                    writer.write(p, block.label if with_label else None)
                    rows += len(p)
                    if with_label:
                        probs.append(p)
                        truth.append(block.label)
        if writer is not None:
            writer.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if rank != 0:
        return None
    auc = logloss = None
    if probs:
        p, y = np.concatenate(probs), np.concatenate(truth)
        auc = float(binary_auroc(torch.from_numpy(p), torch.from_numpy(y.astype(np.int64))))
        q = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
        logloss = float(-np.mean(y * np.log(q) + (1 - y) * np.log1p(-q)))
    return Prediction(rows, auc, logloss, output, (model.unseen, model.raw_values) if model.raw else None)


def input_files(spec: str, data: DataConfig) -> list[Path]:
    """``input=``: a file, files separated by commas, a directory or a glob (the forms of ``data.path``)."""
    from pipeline.data.sources import resolve_paths

    probe = DataConfig(name=data.name, format=data.format, path=spec.split(",") if "," in spec else spec)
    files = resolve_paths(probe)
    return files if isinstance(files, list) else [p for group in files.values() for p in group]


def run(args: PredictArgs) -> Prediction | None:
    """The command with ``args``; None on ranks other than 0."""
    checkpoint, output = Path(args.checkpoint), Path(args.output)
    batch_size, block_size = args.batch_size, args.block_size
    world, _ = world_from_env()

    def score_with(encoder: RowEncoder, score: Callable[[SplitArrays], np.ndarray | None], rank: int = 0):
        return predict(encoder, score, input_files(args.input, encoder.data), output, block_size, rank)

    if world > 1:
        from pipeline.scoring.sharded_scorer import sharded_scorer  # TorchRec's sharding: only under torchrun

        dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout_s))
        return score_with(*sharded_scorer(checkpoint, batch_size), dist.get_rank())
    with tempfile.TemporaryDirectory(prefix="ctr-predict-") as tmp:  # a checkpoint's tables, read in this process
        scorer = Scorer(checkpoint, table_dir=Path(tmp))
        return score_with(scorer, lambda a: scorer.score(a, batch_size))
