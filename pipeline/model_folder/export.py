"""A checkpoint as a model folder (:mod:`.layout`): unsharded weights, vocabularies, the model and
dataset description. A checkpoint written by W processes is read in one (DCP reads every shard of a
table into the whole table), its tables through files beside the output, never whole in memory. The
vocabularies come from the store the run trained on (its path is in the checkpoint), which must be
on this machine."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipeline.model_folder.layout import write_bundle
from pipeline.model_folder.source import model_source
from pipeline.model_folder.weights import read_float_weights, read_zch_state


def export_model(checkpoint: str | Path, out: str | Path, quantize: str = "none") -> Path:
    """The model folder of ``checkpoint`` (or a folder of checkpoints: its newest intact one; or a model
    folder) at ``out``, its tables quantized as ``quantize`` says (:mod:`.quantize`)."""
    source = model_source(checkpoint)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-tables-", dir=Path(out).parent) as scratch:
        weights = read_float_weights(source, Path(scratch))
        return write_bundle(out, weights, source.model_cfg, source.data,
                            source.store_meta, source.vocab_root / "vocab", source.mlflow_run_id, quantize,
                            read_zch_state(source))
