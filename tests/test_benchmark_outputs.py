"""Benchmarks write only where they are pointed (``--work``, else a temporary folder they remove): never into the
checkout, so a read-only or installed checkout works and the repository's disk does not fill.

Statically for every benchmark (no child started in the checkout, no default path under it, temporary folders made
through ``benchmarks/work_folder.py``, which removes them), and by running the cheapest (``loader.py``: a synthetic
log, its store, batches) from another folder against a copy of the checkout whose files are compared before and
after; ``gpu_check.py`` runs the same way in tests/test_gpu_check.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_gpu_check import uninstalled_copy

BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py"))
INTO_THE_CHECKOUT = {
    "a child started in the checkout": r"cwd=ROOT\b|chdir\(ROOT\)",
    "a default path under the checkout": r"ROOT\s*/\s*[\"']\.cache|default=str\(ROOT",
    "a temporary folder left behind (use work_folder)": r"tempfile\.mkdtemp\(",
}


@pytest.mark.parametrize("path", [p for p in BENCHMARKS if p.name != "work_folder.py"], ids=lambda p: p.name)
def test_no_benchmark_writes_into_the_checkout_by_default(path):
    text = path.read_text()
    found = [what for what, pattern in INTO_THE_CHECKOUT.items() if re.search(pattern, text)]
    assert found == [], f"{path.name}: {found}"


def files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()
            and "__pycache__" not in p.parts}


def test_benchmarks_run_from_another_folder_leave_the_checkout_and_that_folder_as_they_were(tmp_path):
    checkout = uninstalled_copy(tmp_path / "checkout")
    where, temp = tmp_path / "elsewhere", tmp_path / "tmp"
    where.mkdir()
    temp.mkdir()
    before = files(checkout)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(temp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(checkout)}
    for cmd in (["loader.py", "--rows", "20000", "--batches", "1024", "--seconds", "0.2", "--model-steps", "0"],):
        proc = subprocess.run([sys.executable, str(checkout / "benchmarks" / cmd[0]), *cmd[1:]], cwd=where, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "| 1,024 |" in proc.stdout  # it measured
    assert files(checkout) == before
    assert list(where.iterdir()) == []
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor")] == []  # (torch's own cache)
