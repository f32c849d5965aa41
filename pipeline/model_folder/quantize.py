"""Quantized embedding tables for serving: row-wise int8 or int4, or fp16 — FBGEMM's fused row-wise
format, scored by TorchRec's quantized ``EmbeddingBagCollection`` / ``EmbeddingCollection`` (FBGEMM's
``IntNBitTableBatchedEmbeddingBagsCodegen`` CPU kernels).

Row-wise asymmetric quantization of a row w with b bits (``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``):

    bias = min_i w_i,   scale = (max_i w_i − bias) / (2^b − 1),   q_i = round((w_i − bias) / scale)

stored as the b-bit codes followed by scale and bias in fp16; the kernel reads w_i ≈ q_i·scale + bias,
an error of at most scale/2 per value. Bytes per row: int8 dim + 4, int4 dim/2 + 4, fp16 2·dim
(float32: 4·dim) — int8 is 0.31× of float32 at dim 16, 0.27× at dim 64.

A model folder written with ``quantize`` keeps each table as ``tables/<parameter>.u8`` (those rows, in
``model.json`` with the float shape); :func:`use_quantized_tables` swaps the model's collections for
quantized ones built from the mapped files. FBGEMM copies a collection's tables into one buffer
(``weights_host``); :func:`share_fused_buffers` writes that buffer to a file once and maps it in its
place, so that server processes scoring the same model hold one copy in the page cache, not one each.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from pipeline.model_folder import table_files

QUANTIZE = ("none", "int8", "int4", "fp16")
DATA_TYPES = {"int8": DataType.INT8, "int4": DataType.INT4, "fp16": DataType.FP16, "fp32": DataType.FP32}
BITS = {"int8": 8, "int4": 4}
SCALE_BIAS_BYTES = 4  # fp16 scale and bias at the end of each int8 / int4 row


def check_quantize(value: str, key: str) -> None:
    if value not in QUANTIZE:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(QUANTIZE)}")


def row_bytes(dim: int, dtype: str) -> int:
    """Bytes of one quantized row of ``dim`` values."""
    if dtype == "fp16":
        return 2 * dim
    return dim * BITS[dtype] // 8 + SCALE_BIAS_BYTES


def quantize_rows(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """[n, dim] float rows → [n, row_bytes] uint8 (see the module docstring)."""
    rows = rows.detach().to(torch.float32).contiguous()
    if dtype == "fp16":
        return rows.half().view(torch.uint8)
    return torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, BITS[dtype])


def write_quantized(path: Path, table: torch.Tensor, dtype: str) -> None:
    """``table`` (2-D float) as a file of quantized rows, block by block (never whole in memory twice)."""
    rows, dim = table.shape
    width = row_bytes(dim, dtype)
    table_files.create(path, rows, width, torch.uint8)
    step = table_files.rows_per_block(4 * dim)
    for start in range(0, rows, step):
        table_files.write_block(path, (rows, width), (start, 0), quantize_rows(table[start:start + step], dtype),
                                torch.uint8)


def _split(q: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes, scale-and-bias) as TorchRec's quantized modules take a table's weights."""
    if dtype == "fp32":  # float tables in the fused kernel: their bytes as they are
        return q.contiguous().view(torch.uint8), None
    if dtype == "fp16":
        return q, None
    return q[:, :-SCALE_BIAS_BYTES], q[:, -SCALE_BIAS_BYTES:]


def use_quantized_tables(model: nn.Module, tables: dict[str, torch.Tensor], dtype: str) -> list[str]:
    """Replace every (float) ``EmbeddingBagCollection`` / ``EmbeddingCollection`` of ``model`` by TorchRec's
    quantized one over ``tables``: parameter name (``<module>.embedding_bags.<table>.weight``) → its
    quantized rows. Returns the names of the replaced modules."""
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, EmbeddingBagCollection):
            configs, member, quantized = module.embedding_bag_configs(), "embedding_bags", QuantEmbeddingBagCollection
        elif isinstance(module, EmbeddingCollection):
            configs, member, quantized = module.embedding_configs(), "embeddings", QuantEmbeddingCollection
        else:
            continue
        configs = [copy.copy(c) for c in configs]
        weights = {}
        for config in configs:
            config.data_type = DATA_TYPES[dtype]
            weights[config.name] = _split(tables[f"{name}.{member}.{config.name}.weight"], dtype)
        kwargs = {"is_weighted": module.is_weighted()} if member == "embedding_bags" else {}
        replacement = quantized(tables=configs, device=torch.device("cpu"), table_name_to_quantized_weights=weights,
                                row_alignment=1, **kwargs)  # rows as stored (FBGEMM's CPU default; TorchRec's: 16)
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attribute, replacement)
        replaced.append(name)
    return replaced


def share_fused_buffers(model: nn.Module, modules: Sequence[str], folder: Path) -> None:
    """Map each fused kernel's table buffer of ``modules`` (from :func:`use_quantized_tables`) from a file in
    ``folder`` (written the first time, under a temporary name then renamed; ``folder`` is one per model)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in modules:
        for i, kernel in enumerate(model.get_submodule(name)._emb_modules):
            host = kernel.weights_host
            path = folder / f"{name}.{i}.bin"
            if not path.is_file() or path.stat().st_size != host.numel():
                tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
                host.numpy().tofile(tmp)
                os.replace(tmp, path)
            kernel.weights_host = torch.from_file(str(path), shared=False, size=host.numel(), dtype=host.dtype)
