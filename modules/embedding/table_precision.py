"""``model.table_precision``: the type embedding rows are stored and updated in — fp32, fp16 or bf16.

FBGEMM's table-batched kernels (``weights_precision``) read a half-precision row, pool in fp32 and write
the fused optimizer's update back in the row's type; the optimizer state (Adagrad's accumulators) stays
fp32. A row of D values takes 2·D bytes instead of 4·D:

    table bytes = rows · (b·D + 4·s),   b = 4 (fp32) or 2 (fp16, bf16),   s = optimizer state floats per row

(row-wise Adagrad: s = 1, so at D = 16 the tables with their state fall to 36/68 = 0.53×).

The update w ← w − η·u is rounded to the row's type. On CUDA FBGEMM rounds stochastically
(``stochastic_rounding``, on by default: E[round(w − η·u)] = w − η·u, so updates smaller than half a unit
in the last place still move the row on average). FBGEMM's CPU kernels round to nearest (measured,
tests/test_table_precision.py): an update below half a unit in the last place of the row's value is lost —
fp16 has 10 mantissa bits, so |η·u| < |w|·2⁻¹² leaves w as it was. bf16 (7 mantissa bits) has no CPU kernel
in FBGEMM (``split_embedding_cpu_forward`` is not built for it): refused on CPU. Also refused: the CPU ``ssd`` tier
(fp32 records). Copies of the tables merged across ranks merge fp32 updates and round each row once
(:mod:`modules.optim.sparse_merging`).

Where the rows go after training: checkpoints hold them as they are (DCP keeps each tensor's type); a model
folder keeps fp16 rows as fp16 (``quantize: fp16``, exactly the trained values) and bf16 rows as fp32
(exactly: every bf16 value is an fp32 value), which ``ctr predict`` and ``ctr serve`` read as they read any folder.
"""

from __future__ import annotations

from torchrec.modules.embedding_configs import DataType

TABLE_PRECISIONS = ("fp32", "fp16", "bf16")
DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}
DATA_TYPE_BYTES = {DataType.FP32: 4, DataType.FP16: 2, DataType.BF16: 2}
FOLDER_FORMAT = {"fp32": "none", "fp16": "fp16", "bf16": "none"}  # a model folder's tables (pipeline/model_folder/quantize.py)


def precision_of(configs: list) -> str:
    """The table precision of TorchRec table configs (``data_type``): the one they share."""
    found = {c.data_type for c in configs} or {DataType.FP32}
    if len(found) > 1:
        raise ValueError(f"tables in {sorted(d.value for d in found)}: one model.table_precision for all tables")
    (data_type,) = found
    return next(k for k, v in DATA_TYPES.items() if v == data_type)


def table_bytes(placements: dict, precision: str) -> dict[str, int]:
    """The tables' bytes of a plan (its placements, each ``rows``, ``dim`` and ``bytes``: weights with the optimizer
    state): ``table_bytes`` and, the weights alone, ``table_weight_bytes`` = Σ rows · dim · bytes a value."""
    value = DATA_TYPE_BYTES[DATA_TYPES[precision]]
    return {"table_bytes": int(sum(p.bytes for p in placements.values())),
            "table_weight_bytes": int(sum(p.rows * p.dim * value for p in placements.values()))}


def check_table_precision(value: str, key: str = "model.table_precision") -> None:
    if value not in TABLE_PRECISIONS:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(TABLE_PRECISIONS)}")


def table_precision_refusal(value: str, compute_device: str, embedding_optim: str, fused: bool,
                            ssd_tables: list[str]) -> str | None:
    """Why ``model.table_precision=value`` cannot run here, or None."""
    if value == "fp32":
        return None
    if value == "bf16" and compute_device == "cpu":
        return ("model.table_precision=bf16: FBGEMM's CPU kernels have no bf16 tables; use fp16 on the CPU "
                "(bf16 tables run on CUDA)")
    if not fused:
        return (f"model.table_precision={value}: half-precision rows need FBGEMM's fused update, and "
                f"optim.embedding.name={embedding_optim} has none on {compute_device} (the tables would be "
                f"data-parallel, updated by torch.optim in {value}); use sgd, adagrad or rowwise_adagrad, or fp32 tables")
    if ssd_tables:
        return (f"model.table_precision={value}: the ssd tier keeps fp32 records (modules/embedding/ssd_tier); "
                f"tables {sorted(ssd_tables)} are placed there — keep them in host memory or use fp32 tables")
    return None
