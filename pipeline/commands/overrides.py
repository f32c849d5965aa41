"""The command line's overrides checked before Hydra runs a command: a bad one ends it with one line and status 2.

Hydra reports a misspelt key in 7 lines with status 1 and suggests ``+key=value``, which then adds the key beside the
real one and runs as if it were not there. Here the command's config is composed once with the same search path Hydra
uses (the configs, then ``--config-dir``), and:

* a key the schema does not have — with or without ``+`` — is refused naming the key, the nearest keys of its group
  (``difflib``) and where the group is documented; ``+`` adds keys only where the schema has a mapping of free keys
  (``topology.table_overrides.<table>``, ``trainer.callbacks``' entries) and config groups (``+experiment=...``);
* a value of the wrong type names the key, the value and the type expected;
* an unknown option of a group lists the group's options on the same line.

``--help``, ``--cfg``, ``--info`` and multiruns (whose values are sweeps) are left to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from pipeline.commands.args import EXIT_USER_ERROR
from pipeline.runtime.errors import ConfigError

GROUP_FILES = {"data": "conf/data/synthetic.yaml", "model": "conf/model/deepfm.yaml", "optim": "conf/optim/default.yaml",
               "scaling": "conf/scaling/base.yaml", "topology": "conf/topology/cpu.yaml",
               "trainer": "conf/trainer/default.yaml", "logger": "conf/logger/mlflow.yaml"}


def unknown_keys(node: Any, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Every key of a composed config that its node's schema (a dataclass) lacks: (full key, the node's keys)."""
    found: list[tuple[str, list[str]]] = []
    if isinstance(node, DictConfig):
        schema = OmegaConf.get_type(node)
        known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
        for key in node.keys():
            full = f"{prefix}.{key}" if prefix else str(key)
            if known is not None and key not in known:
                found.append((full, known))
            else:
                found += unknown_keys(node._get_node(key), full)
    elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        for i in range(len(node)):
            found += unknown_keys(node._get_node(i), f"{prefix}[{i}]")
    return found


def where_documented(key: str, config_name: str) -> str:
    group = key.split(".")[0]
    command = "train" if config_name == "config" else config_name
    return f"{GROUP_FILES.get(group, f'conf/{config_name}.yaml')} and `ctr {command} --help`"


def unknown_key_message(key: str, known: list[str], config_name: str) -> str:
    parent, _, name = key.rpartition(".")
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    full = [f"{parent}.{k}" if parent else k for k in near]
    hint = f"; did you mean {' or '.join(full)}?" if full else ""
    return (f"{key} is not a key of {parent or 'the config'}{hint} ({parent or 'the config'}'s keys: "
            f"{where_documented(key, config_name)})")


def _expected_type(base: DictConfig, key: str) -> str:
    try:
        parent, _, name = key.rpartition(".")
        node = (OmegaConf.select(base, parent) if parent else base)._get_node(name)
        ref = node._metadata.ref_type
        return getattr(ref, "__name__", None) or str(ref).replace("typing.", "")
    except Exception:  # noqa: BLE001 - the message then says less
        return "another type"


def _key(override: str) -> str:
    """The key an override (or a full key) names, as ``a.b.0.c``."""
    return override.lstrip("+~").split("=", 1)[0].replace("[", ".").replace("]", "")


def composition_message(e: Exception, overrides: list[str], compose: Any, config_name: str) -> str:
    """One line for what composing the command line raised."""
    cause = e.__cause__ or e.__context__
    if isinstance(e, MissingConfigException) or isinstance(cause, MissingConfigException):
        text = str(cause if isinstance(cause, MissingConfigException) else e).split("Config search path")[0]
        head, _, options = text.partition("Available options")
        listed = ", ".join(line.strip() for line in options.splitlines()[1:] if line.strip())
        return " ".join(head.split()) + (f"; available: {listed}" if listed else "")
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        base = compose([o for o in overrides if _key(o) != _key(cause.full_key)])
        parent, _, _ = cause.full_key.rpartition(".")
        node = OmegaConf.select(base, parent) if parent else base
        return unknown_key_message(cause.full_key, list(node.keys()) if isinstance(node, DictConfig) else [],
                                   config_name)
    if isinstance(cause, ValidationError) and cause.full_key:
        value = next((o.split("=", 1)[1] for o in overrides if _key(o) == _key(cause.full_key)), "?")
        base = compose([o for o in overrides if _key(o) != _key(cause.full_key)])
        return f"{cause.full_key}={value}: expected {_expected_type(base, cause.full_key)} ({cause.msg.splitlines()[0]})"
    return " ".join(str(e).split())


def check_overrides(config_path: str, config_name: str, argv: list[str] | None = None) -> None:
    """Compose ``config_name`` with ``argv`` (default: this process's) as Hydra will; exit 2 with one line if bad."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.help or args.hydra_help or args.cfg or args.info or args.multirun or args.shell_completion:
        return
    overrides = [o for o in args.overrides if not o.startswith("hydra.") and not o.startswith("+hydra.")]
    search_path = create_automatic_config_search_path(None, None, config_path)
    if args.config_dir is not None and os.path.isdir(args.config_dir):
        from hydra.core.config_search_path import SearchPathQuery
        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(args.config_dir)}",
                            anchor=SearchPathQuery(provider="schema"))
    hydra = Hydra.create_main_hydra2(task_name="ctr", config_search_path=search_path)

    def compose(given: list[str]) -> DictConfig:
        return hydra.compose_config(args.config_name or config_name, given, run_mode=RunMode.RUN,
                                    with_log_configuration=False)
    try:
        try:
            OverridesParser.create().parse_overrides(overrides)
            cfg = compose(overrides)
        except (ConfigCompositionException, MissingConfigException, OverrideParseException) as e:
            refuse(composition_message(e, overrides, compose, config_name))
            return
        extra = [(key, known) for key, known in unknown_keys(cfg) if key.split(".")[0] != "hydra"]
        if extra:
            refuse(unknown_key_message(*extra[0], config_name))
    finally:
        GlobalHydra.instance().clear()


def refuse(message: str) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise ConfigError(message)
    print(f"Error (ConfigError): {message}\nHint: {ConfigError.hint}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)
