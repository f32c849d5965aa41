"""Every ``ctr`` command in the README and docs composes as written: its groups, keys and values exist and type-check
(the check each command makes before Hydra runs it, :mod:`pipeline.commands.overrides`), and a command that names a
user's dataset (``data=mylog``) says where its declaration lives (``--config-dir``, given here the declaration
docs/datasets.md shows). Placeholders (``<run id>``) and elisions (``...``) stand for a user's values. The requests
docs/model_use.md sends to a served ``mylog`` model (rows, and ranking requests) carry every column that declaration reads.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = {"train": ("", "config"), "daily": ("", "config"), "plan": ("", "config"), "predict": ("", "predict"),
           "export": ("", "export"), "sync": ("", "sync"), "report": ("", "report"), "serve": ("serving", "serve")}


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) of every ``ctr ...`` in a fenced block (continued lines joined) or in backticks."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            found += [(doc.name, line.split("  #")[0].strip()) for line in joined.splitlines()
                      if line.strip().startswith("ctr ")]
        outside = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(doc.name, c.strip()) for c in re.findall(r"`(ctr [a-z]+ [^`]*)`", outside)]
    return found


def mylog_declaration() -> str:
    text = (ROOT / "docs" / "datasets.md").read_text()
    return next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("name: mylog"))


@pytest.fixture(scope="module")
def user_conf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("my_conf")
    (folder / "data").mkdir()
    (folder / "data" / "mylog.yaml").write_text(mylog_declaration())
    return folder


COMMANDS = documented_commands()


def test_the_docs_hold_commands_to_check():
    assert len(COMMANDS) > 50 and any(doc == "README.md" for doc, _ in COMMANDS)


@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_a_documented_command_composes_as_written(doc, command, user_conf, capsys):
    line = re.sub(r"<[^>]*>", "X", command)  # a placeholder is a value the user gives
    line = re.sub(r" \[([a-z_.]+=[^\]]*)\]", r" \1", line)  # [key=value]: an optional argument, shown
    words = shlex.split(line)
    name, args = words[1], [w for w in words[2:] if w != "..." and not w.endswith("=...")]
    if "-m" in args or "--multirun" in args:
        pytest.skip("a sweep: its values are lists (Hydra's own check)")
    if "data=mylog" in args:
        assert "--config-dir" in args, f"{doc}: `{command}` names data=mylog without --config-dir (where it lives)"
    if "--config-dir" in args:
        args[args.index("--config-dir") + 1] = str(user_conf)
    group, config = CONFIGS[name]
    try:
        check_overrides(config_path(group), config, args)
    except SystemExit:
        pytest.fail(f"{doc}: `{command}` does not compose: {capsys.readouterr().err.strip()}")


def test_the_documented_requests_to_a_served_mylog_model_carry_every_column_it_reads():
    declared = yaml.safe_load(mylog_declaration())
    needs = {f.get("column", f["name"]) for f in declared["features"]}
    text = (ROOT / "docs" / "model_use.md").read_text()
    bodies = re.findall(r"-d '(\{\"dataframe_split\".*?)'", text)
    assert bodies
    for body in bodies:
        columns = set(json.loads(body)["dataframe_split"]["columns"])
        assert columns >= needs, f"a request lacks {sorted(needs - columns)}"
    rank = re.findall(r"-d '(\{\"context\".*?)'", text, re.S)  # POST /rank: each column once, in one of the parts
    assert rank
    for body in rank:
        doc = json.loads(body)
        context, candidates = set(doc["context"]), set(doc["candidates"])
        assert not context & candidates and context | candidates >= needs, (context, candidates, needs)
