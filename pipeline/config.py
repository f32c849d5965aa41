"""The run's configuration as typed objects: Hydra structured configs, parsed and checked once.

``conf/config.yaml`` starts its defaults list with the schema :class:`RunConfig` (registered in
Hydra's ConfigStore as ``run_schema`` by :func:`register_configs`), so every group file and command-line override is merged onto
typed nodes: a misspelt key or a value of the wrong type stops composition with Hydra's message naming
the key. :func:`parse_config` then builds the dataclasses, whose ``__post_init__`` checks run once,
and :func:`check_runnable` checks what training needs of the machine (world size, CUDA, input files). Every error is a
:class:`ConfigError` whose message starts with the full key.

The dataclasses of the groups live beside the code they configure: ``OptimizerSpec``
(:mod:`modules.optim.optimizers`), ``CowClipConfig`` (:mod:`modules.optim.cowclip`), ``MergeConfig``
(:mod:`modules.optim.kstep_merging`), ``TopologySpec`` (:mod:`modules.sharding.placement`), ``ModelConfig``
(:mod:`modules.models`), ``DataConfig`` (:mod:`pipeline.data.dataset`) with ``PreprocessConfig`` and
``SyntheticConfig``, ``LoggerConfig`` (:mod:`pipeline.tracking.logger_config`); this module adds the trainer and scaling settings and the root.

May import: tracking, model_folder, checkpoint, data, runtime, modules
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, MissingMandatoryValue, OmegaConf

from modules.embedding.table_precision import table_precision_refusal
from modules.optim.cowclip import CowClipConfig
from modules.optim.embedding_l2 import L2_SCOPES
from modules.optim.kstep_merging import MergeConfig
from modules.sharding.comm_precision import CommsConfig
from modules.models import ModelConfig
from modules.optim.optimizers import OptimizerSpec, is_fusable
from modules.optim.scaling_rules import EMBEDDING_LR_RULES, RULES
from modules.sharding.topology import TopologySpec
from pipeline.data.dataset import DataConfig
from pipeline.data.sources import raw_fingerprint
from pipeline.runtime.config_source import PACKAGE, config_path
from pipeline.runtime.errors import ConfigError
from pipeline.runtime.launch import world_from_env
from pipeline.runtime.signals import PreemptionConfig
from pipeline.model_folder.source import model_source
from pipeline.tracking.logger_config import LoggerConfig

PRECISIONS = ("auto", "32-true", "32", "bf16-mixed", "16-mixed", "bf16-true")  # auto: pipeline/training/precision.py
NONFINITE_POLICIES = ("stop", "skip")
CUDA_REFUSED = {  # what does not run on CUDA yet, and why (check_runnable; docs/gpu.md)
    "model.zch": "its id mapping, admission buffers and row resets are host-side structures fed by the batch's ids",
    "optim.embedding_l2_scope=all": "its lazy replay keeps each row's last step in host memory and reads it at every "
                                    "lookup; use optim.embedding_l2_scope=batch",
    "topology.ssd.look_ahead=true": "it fills the CPU ssd tier's row cache; FBGEMM's SSD tables on a GPU prefetch "
                                    "themselves"}
INIT_OPTIMIZER_PARTS = ("none", "embedding", "dense", "all")  # trainer.init_from_optimizer (pipeline/training/init_from.py)


@dataclass
class OptimConfig:
    """``optim``: base hyperparameters, tuned for ``scaling.base_batch_size`` (each ``conf/optim`` file sets it)."""

    dense: OptimizerSpec = field(default_factory=lambda: OptimizerSpec("adam", 1e-3))
    embedding: OptimizerSpec = field(default_factory=lambda: OptimizerSpec("rowwise_adagrad", 0.01))
    embedding_l2: float = 0.0          # λ of the L2 term 2λ·w_k (0: off)
    embedding_l2_scope: str = "batch"  # batch: the ids in each batch | all: every row, every step (modules/optim/embedding_l2.py)

    def __post_init__(self) -> None:
        if self.embedding_l2 < 0:
            raise ValueError(f"embedding_l2={self.embedding_l2}: expected λ >= 0")
        if self.embedding_l2_scope not in L2_SCOPES:
            raise ValueError(f"embedding_l2_scope={self.embedding_l2_scope!r}: expected one of {L2_SCOPES}")


@dataclass
class ScalingConfig:
    """``scaling``: how ``optim`` is rescaled to the run's batch (:mod:`modules.optim.scaling_rules`), and CowClip."""

    rule: str = "none"
    base_batch_size: int = 1024
    warmup_epochs: Optional[float] = 0.0  # linear warmup of the dense LR (epochs); None: 1 above the base batch
    embedding_lr: str = "rule"         # rule (the rule's) | fixed | sqrt | linear: the embedding LR's own scaling
    embedding_warmup_epochs: float = 0.0  # linear warmup of the embedding LR (fused tables too)
    cowclip: CowClipConfig = field(default_factory=CowClipConfig)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule={self.rule!r}: expected one of {RULES}")
        if self.embedding_lr not in EMBEDDING_LR_RULES:
            raise ValueError(f"embedding_lr={self.embedding_lr!r}: expected one of {EMBEDDING_LR_RULES}")
        if self.base_batch_size <= 0 or (self.warmup_epochs or 0) < 0 or self.embedding_warmup_epochs < 0:
            raise ValueError(f"base_batch_size={self.base_batch_size}, warmup_epochs={self.warmup_epochs}, "
                             f"embedding_warmup_epochs={self.embedding_warmup_epochs}: expected a positive batch "
                             f"size and warmups >= 0")


@dataclass
class CheckpointConfig:
    """``trainer.checkpoint``: sharded checkpoints (:mod:`pipeline.checkpoint`); ``dir`` None: none."""

    dir: Optional[str] = None
    every_n_steps: Optional[int] = None   # also every N training steps (always at the end of each epoch)
    keep: int = 2                         # newest complete checkpoints kept
    chunk_mb: float = 64.0                # tables are written and read in row blocks of this size (bounded memory)

    def __post_init__(self) -> None:
        if self.keep < 1 or (self.every_n_steps is not None and self.every_n_steps < 1):
            raise ValueError(f"keep={self.keep}, every_n_steps={self.every_n_steps}: expected values >= 1")
        if self.chunk_mb <= 0:
            raise ValueError(f"chunk_mb={self.chunk_mb}: expected a size in MB > 0")


@dataclass
class TrainerConfig:
    """``trainer`` (``conf/trainer/default.yaml`` says what each key does)."""

    batch_size: int = 4096
    eval_batch_size: int = 16384
    max_epochs: int = 1
    max_steps: int = -1
    shuffle: bool = True                # training rows in a new random order each epoch; false: the files' order
    precision: str = "auto"            # bf16-mixed where the device computes bf16 natively, else 32-true
    num_threads: Optional[int] = None
    log_every_n_steps: int = 25
    val_check_interval: Any = 1.0       # a float: share of an epoch; an int: every that many batches
    enable_progress_bar: bool = True
    early_stopping_patience: Optional[int] = None
    plateau_lr_factor: Optional[float] = None
    plateau_patience: int = 1
    merging: MergeConfig = field(default_factory=MergeConfig)
    comms: CommsConfig = field(default_factory=CommsConfig)  # precision of each collective (modules/sharding/comm_precision.py)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)  # signals: pipeline/runtime/signals.py
    resume: Optional[str] = None
    init_from: Optional[str] = None     # start from this model folder / checkpoint's weights (new data, grown tables)
    init_from_optimizer: str = "none"   # also carry a checkpoint's optimizer state: none | embedding | dense | all
    nonfinite: str = "stop"
    nonfinite_check_every: int = 16     # under stop: steps between two host reads of the noted flags
    callbacks: List[Any] = field(default_factory=list)  # extra Lightning callbacks: {_target_: ..., ...}
    collective_timeout_s: float = 600.0  # a collective (or the process group's start) waiting longer fails the run

    def local_batches(self, world: int) -> tuple[int, int]:
        """Each rank's rows of a training and an evaluation batch: ``batch_size`` and ``eval_batch_size`` are global,
        split evenly over the ``world`` ranks (the one reading of both; :func:`check_runnable` checks they split)."""
        return self.batch_size // world, self.eval_batch_size // world

    def __post_init__(self) -> None:
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s}: expected a positive number of seconds")
        for key in ("batch_size", "eval_batch_size", "max_epochs", "plateau_patience", "nonfinite_check_every"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)!r}: expected a positive integer")
        if str(self.precision) not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: expected one of {PRECISIONS}")
        if self.init_from_optimizer not in INIT_OPTIMIZER_PARTS:
            raise ValueError(f"init_from_optimizer={self.init_from_optimizer!r}: expected one of {INIT_OPTIMIZER_PARTS}")
        if self.init_from_optimizer != "none" and not self.init_from:
            raise ValueError(f"init_from_optimizer={self.init_from_optimizer!r}: needs trainer.init_from (a checkpoint)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={self.nonfinite!r}: expected one of {NONFINITE_POLICIES}")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience={self.early_stopping_patience}: expected >= 1 or null")
        if self.plateau_lr_factor is not None and not 0 < self.plateau_lr_factor < 1:
            raise ValueError(f"plateau_lr_factor={self.plateau_lr_factor}: expected a factor in (0, 1) or null")


@dataclass
class PathsConfig:
    cache_dir: str = ".cache/data"     # generated raw data and preprocessed stores


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    topology: TopologySpec = field(default_factory=TopologySpec)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    seed: int = 2026


RESOLVERS = {  # for conf/hydra/launcher/slurm.yaml: the first value that is set; GPUs per node on CUDA topologies
    "ctr_first": lambda *values: next((v for v in values if v is not None), None),
    "ctr_gpus": lambda device, ranks: ranks if device == "cuda" else None,
}


def register_configs() -> None:
    """Make ``conf/`` composable: the schema :class:`RunConfig` as ``run_schema`` in Hydra's ConfigStore
    (``conf/config.yaml``'s defaults start with it) and the resolvers ``conf/`` uses. Every command that
    composes ``config`` calls it first; :func:`unregister_configs` undoes it."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    for name, fn in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)


def unregister_configs() -> None:
    ConfigStore.instance().repo.pop("run_schema.yaml", None)
    for name in RESOLVERS:
        if OmegaConf.has_resolver(name):
            OmegaConf.clear_resolver(name)


def compose_config(overrides: Sequence[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """``config`` composed with ``overrides`` outside a Hydra app (benchmarks, tests), from where the commands read
    it (:mod:`pipeline.runtime.config_source`: the installed ``ctr_conf``, else the checkout's ``conf/``)."""
    register_configs()
    source = config_path()
    context = initialize_config_module(PACKAGE, version_base="1.3") if source.startswith("pkg://") else \
        initialize_config_dir(source, version_base="1.3")
    with context:
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def compose_run_config(overrides: Sequence[str] = ()) -> "RunConfig":
    """The typed config of ``config`` composed with ``overrides`` (:func:`compose_config`, :func:`parse_config`)."""
    return parse_config(compose_config(overrides))


def to_typed(node: DictConfig, key: str = "") -> Any:
    """``OmegaConf.to_object`` with the full key of a failing ``__post_init__`` in the error."""
    try:
        return OmegaConf.to_object(node)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is missing: set {e.full_key}=<value>") from None
    except (ValueError, TypeError) as e:
        for k in node:  # find the innermost node that fails, for its key
            child = node._get_node(k)
            if isinstance(child, DictConfig) and OmegaConf.get_type(child) not in (dict, None):
                to_typed(child, f"{key}.{k}" if key else str(k))
            elif isinstance(child, ListConfig) and not child._is_none():  # lists of typed entries (data.features)
                for i, item in enumerate(child):
                    if isinstance(item, DictConfig) and OmegaConf.get_type(item) not in (dict, None):
                        to_typed(item, f"{key}.{k}[{i}]" if key else f"{k}[{i}]")
        message = str(e)  # a config class may name its keys in full already (model.zch.rows=...)
        raise ConfigError(f"{key}.{message}" if key and not message.startswith(f"{key}.") else message) from None


def parse_config(cfg: DictConfig) -> RunConfig:
    """The typed config of a composed one; raises :class:`ConfigError` naming the key.
    ``data.preprocess.base_vocabulary=auto`` becomes the vocabulary of ``trainer.init_from`` (or none)."""
    run = to_typed(cfg if OmegaConf.get_type(cfg) is RunConfig else OmegaConf.merge(RunConfig, cfg), "")
    if run.data.preprocess.base_vocabulary == "auto":
        run.data.preprocess.base_vocabulary = _source_vocabulary(run.trainer.init_from)
    return run


def _source_vocabulary(init_from: Optional[str]) -> Optional[str]:
    """The folder holding the vocabularies of a model folder or checkpoint to continue from (its description
    alone: parsing hashes no checkpoint; the run checks the source once, :func:`pipeline.training.run.train`)."""
    if not init_from:
        return None
    try:
        return str(model_source(init_from, verify=False).vocab_root)
    except (OSError, ValueError) as e:
        raise ConfigError(f"trainer.init_from={init_from}: {e}") from None


def check_runnable(run: RunConfig) -> None:
    """What training needs of this machine and launch: batch sizes that split over the ranks, CUDA
    where the topology computes on it, the input files. Raises :class:`ConfigError`."""
    world, _ = world_from_env()
    zch, categorical = run.model.zch, run.data.preprocess.categorical
    for key in ("batch_size", "eval_batch_size"):
        bs = getattr(run.trainer, key)
        if bs % world:
            raise ConfigError(f"trainer.{key}={bs} is not divisible by the world size {world} (WORLD_SIZE); "
                              f"each rank needs an equal share of the global batch")
    emb = run.optim.embedding
    if emb.weight_decay and is_fusable(emb, run.topology.compute_device):
        raise ConfigError(f"optim.embedding.weight_decay={emb.weight_decay:g}: FBGEMM's fused {emb.name} ignores "
                          f"it (no weight_decay_mode acts on the CPU kernels; tests/test_config.py checks); use "
                          f"optim.embedding_l2=<λ> (2λ·w on looked-up rows, or every row with "
                          f"optim.embedding_l2_scope=all)")
    why = table_precision_refusal(run.model.table_precision, run.topology.compute_device, emb.name,
                                  is_fusable(emb, run.topology.compute_device), [])
    if why:
        raise ConfigError(why)
    if run.topology.compute_device == "cuda":
        on = {"model.zch": zch.enabled, "optim.embedding_l2_scope=all": run.optim.embedding_l2_scope == "all",
              "topology.ssd.look_ahead=true": run.topology.ssd.look_ahead}
        for key in (k for k, used in on.items() if used):
            raise ConfigError(f"{key} with topology.compute_device=cuda: not supported on CUDA yet ({CUDA_REFUSED[key]}); "
                              f"leave {key.split('=')[0]} at its default or use topology=cpu")
        if not torch.cuda.is_available():
            raise ConfigError("topology.compute_device='cuda' but no CUDA device is available; use topology=cpu")
    if not run.data.declared():
        raise ConfigError(f"data.features is empty: declare the features of data={run.data.name} "
                          f"(see docs/datasets.md)")
    if zch.enabled != (categorical == "raw"):
        raise ConfigError(f"model.zch.rows={zch.rows} with data.preprocess.categorical={categorical}: zero-collision "
                          f"tables take raw ids and raw ids need them (set both, or neither)")
    if run.topology.ssd.look_ahead and (world > 1 or zch.enabled):
        raise ConfigError(f"topology.ssd.look_ahead=true needs one process and no model.zch (here {world} process(es)"
                          f"{', model.zch' if zch.enabled else ''}): a kernel's next ids are not known ahead; set it false")
    if run.data.shape_only:
        raise ConfigError(f"data={run.data.name} describes a shape for planning only (ctr plan); "
                          f"train on a dataset with files")
    try:
        raw_fingerprint(run.data)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def plain(obj: Any) -> Any:
    """A typed config as plain containers (for MLflow parameters and checkpoints)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
