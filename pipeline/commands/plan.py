"""Show where the embedding tables go: ``ctr plan topology=<name> data=<name> [model=...]``.

Prints one row per table — rows, dim, bytes (weights + optimizer state), sharding type, tier and
kernel, ranks — and the estimated memory per tier per rank (TorchRec's planner estimates); then what runs
for the inter-node link (merge period, communication precision: pipeline/training/link_choice.py) with the
estimated step time, its compute measured on this machine. Works
without a GPU: GPU topologies are planned, not run. ``data`` may be a prepared dataset (its measured
id-frequency statistics size the caches) or a shape-only description such as ``criteo_kaggle_shape``.
"""

from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig

from modules.embedding.sparse_arch import FeatureSpec
from modules.models import build_model
from modules.optim.embedding_l2 import row_state_bytes
from modules.sharding.plan_report import format_plan
from modules.sharding.planner import plan_model
from modules.sharding.table_stacking import decide_stacking
from modules.embedding.zch.config import ZchConfig
from modules.zipf import zipf_coverage
from pipeline.commands.args import exit_on_user_error
from pipeline.config import parse_config, register_configs
from pipeline.data.datamodule import CTRDataModule
from pipeline.data.dataset import DataConfig
from pipeline.data.store import FIRST_VOCAB_ID, SplitArrays
from pipeline.runtime.errors import ConfigError
from pipeline.training.link_choice import LinkSettings
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path


def spec_and_coverage(data: DataConfig, cache_dir: str, zch: ZchConfig | None = None
                      ) -> tuple[FeatureSpec, dict[str, dict[float, int]], SplitArrays | None]:
    """Feature spec, id-coverage statistics and training split of a dataset (prepared on first use), or the
    spec and coverage of a shape-only config (no split)."""
    if data.shape_only:
        tables = list(dict.fromkeys(data.table_of(f) for f in (*data.categorical, *data.sequence)))
        if data.cardinalities is None or len(data.cardinalities) != len(tables):
            raise ConfigError(f"data.cardinalities: expected {len(tables)} counts (one per embedding table: "
                              f"{tables[:5]}{' ...' if len(tables) > 5 else ''})")
        sizes = {t: int(n) + FIRST_VOCAB_ID for t, n in zip(tables, data.cardinalities)}
        coverage = {t: zipf_coverage(n, data.zipf_exponent) for t, n in sizes.items()}
        return FeatureSpec.of_data(data, sizes), coverage, None
    dm = CTRDataModule(data, cache_dir, batch_size=1, eval_batch_size=1, seed=0, zch=zch)
    dm.prepare_data()
    dm.setup()
    return dm.feature_spec, dm.coverage, dm.store.split("train")


def plan_for_config(cfg: DictConfig) -> str:
    run = parse_config(cfg)
    topology = run.topology.for_world(run.topology.world_size, run.topology.ranks_per_node or 1)
    feature_spec, coverage, train = spec_and_coverage(run.data, run.paths.cache_dir, run.model.zch)
    optim = run.optim.embedding
    # row caches and the step's working set as training sizes them (CTRTask): the global batches, each rank's share
    local, local_eval = run.trainer.local_batches(topology.world_size)
    l2_state = row_state_bytes(run.optim.embedding_l2_scope)
    model_cfg, stacking = decide_stacking(run.model, feature_spec, topology, optim, coverage, run.trainer.batch_size,
                                          run.trainer.eval_batch_size, l2_state)
    model = build_model(model_cfg, feature_spec, device=torch.device("meta"))
    link = LinkSettings.of(run).resolved(model_cfg, feature_spec, model, topology, run.trainer.batch_size, train)
    span = link.copy_span or topology.world_size  # with copies of the tables, the ranks one copy is sharded over
    planned = topology.on_ranks(span) if link.copy_span else topology
    result = plan_model(model, optim, planned, coverage, table_of={f: feature_spec.table_of(f) for f in feature_spec.sparse},
                        batch_rows=local * span, eval_rows=local_eval * span,  # what one table-wise kernel sees
                        row_state_bytes=l2_state)
    copies = (f"; the tables planned over one copy's {span} rank(s) (trainer.merging.tables={link.merging.tables})"
              if link.copy_span else "")
    title = (f"Plan for data={run.data.name} model={run.model.name} on topology={topology.name} "
             f"({topology.nodes} node(s) × {topology.ranks_per_node} {topology.compute_device} rank(s){copies}), "
             f"embedding optimizer {optim.name}, rows in {model_cfg.table_precision}, "
             f"stacked one-id tables: {str(model_cfg.stack_tables).lower()} "
             f"({stacking}); batch {run.trainer.batch_size:,} ({local:,} a rank; a table-wise kernel sees "
             f"{local * span:,})\n")
    return format_plan(result, optim.name, span, title) + "\n" + link.describe()


@hydra.main(version_base="1.3", config_path=config_path(), config_name="config")
def main(cfg: DictConfig) -> None:
    print(exit_on_user_error(lambda: plan_for_config(cfg)))


def cli() -> None:
    """``ctr plan`` / ``python -m pipeline.commands.plan``."""
    register_configs()
    check_overrides(config_path(), "config")
    main()


if __name__ == "__main__":
    cli()
