"""The package's layering, from its own source: each part of ``pipeline/`` and of ``modules/`` says in its
docstring which other parts it may import (a line ``May import: a, b``), and no import goes elsewhere;
``modules/`` imports nothing of ``pipeline/``; no module imports itself back through others (no cycles); no file
outside tests is much over 300 lines.

The import graph is read with ``ast`` (every ``import``, also inside functions), not by importing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "modules").rglob("*.py")])
MAX_LINES = 310


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The layer a module belongs to: ``modules.<subpackage>`` (``modules`` for the files directly in it),
    ``pipeline.config`` or ``pipeline.<subpackage>``."""
    parts = module.split(".")
    if parts[0] == "modules" and not (len(parts) > 1 and (ROOT / "modules" / parts[1]).is_dir()):
        return "modules"
    return ".".join(parts[:2])


def imports(path: Path) -> set[str]:
    """Every project module ``path`` imports (``from pipeline import x`` counts as ``pipeline.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    known = {module_name(p) for p in SOURCES}
    return {m for m in found if m in known and m not in ("pipeline", "modules")}


GRAPH = {module_name(p): imports(p) for p in SOURCES}
PARTS = sorted({part_of(m) for m in GRAPH if m not in ("pipeline", "modules")})


def allowed(part: str) -> set[str]:
    """The parts named on the ``May import:`` line of ``part``'s docstring (the files directly in ``modules/``
    name no line: none). A part of ``pipeline/`` names its peers without the prefix, and ``modules`` for all
    of ``modules/``; a part of ``modules/`` names parts in full (``modules``: the files directly in it)."""
    if part == "modules":
        return set()
    path = ROOT / part.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = re.search(r"^May import: *(.*)$", doc, re.MULTILINE)
    assert line, f"{path.relative_to(ROOT)}: its docstring has no 'May import:' line"
    names = [n.strip().rstrip(".") for n in line.group(1).split(",") if n.strip() and n.strip() != "nothing"]
    if part.startswith("modules"):
        return set(names)
    return {n for n in names if n.startswith("modules.")} | \
        ({p for p in PARTS if p.startswith("modules")} if "modules" in names else set()) | \
        {f"pipeline.{n}" for n in names if not n.startswith("modules")}


@pytest.mark.parametrize("part", PARTS)
def test_each_part_imports_only_what_its_docstring_allows(part):
    may = allowed(part) | {part}
    wrong = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if part_of(m) == part
                   for t in targets if part_of(t) not in may)
    assert not wrong, "\n".join(wrong)


def test_the_parts_form_layers():
    """The allowed imports between parts have no cycle, so every import goes one way: down."""
    edges = {p: allowed(p) - {p} for p in PARTS}
    done: set[str] = set()

    def visit(p: str, stack: tuple[str, ...]) -> None:
        assert p not in stack, "cycle between parts: " + " -> ".join((*stack, p))
        if p not in done:
            for q in edges.get(p, ()):
                visit(q, (*stack, p))
            done.add(p)

    for p in PARTS:
        visit(p, ())


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, set()) - {v}:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            connect(v)
    return cycles


def test_no_module_imports_itself_back():
    assert not cycles_of(GRAPH), f"import cycles: {cycles_of(GRAPH)}"


def test_the_checks_see_a_cycle_and_an_import_from_another_part():
    assert cycles_of({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles_of({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert part_of("pipeline.training.task") == "pipeline.training"
    assert part_of("pipeline.config") == "pipeline.config" and part_of("modules.models.dcn") == "modules.models"
    assert part_of("modules.embedding.ssd_tier.row_cache") == "modules.embedding" and part_of("modules.zipf") == "modules"
    assert allowed("modules.sharding") == {"modules", "modules.embedding", "modules.models", "modules.optim"} and \
        "modules.embedding" in allowed("pipeline.data")
    assert "pipeline.training.task" in GRAPH["pipeline.training.daily"] | GRAPH["pipeline.commands.train"] \
        or any(part_of(t) == "pipeline.training" for t in GRAPH["pipeline.commands.train"])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_file_is_much_over_300_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by concern"


GROUP_MAKERS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_process_group")


def test_every_process_group_the_project_makes_takes_a_timeout():
    """Every process group made in ``pipeline/`` and ``modules/`` is given a timeout (``trainer.collective_timeout_s``
    reaches it): without one, gloo waits 30 minutes for a rank that stopped answering."""
    missing = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = getattr(getattr(node, "func", None), "attr", None) or getattr(getattr(node, "func", None), "id", None)
            if isinstance(node, ast.Call) and name in GROUP_MAKERS and \
                    not any(k.arg == "timeout" for k in node.keywords):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...) without timeout=")
    assert not missing, "\n".join(missing)
