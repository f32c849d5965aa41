"""Check that every pinned version of the project's CPU and GPU stacks exists on the package index,
for the platform it is meant for, and that the Dockerfile and the README's GPU install pin the same
versions as ``pyproject.toml``'s ``gpu`` extra, that the ``cpu`` and ``gpu`` extras pin the same torch and
torchrec, and that the fbgemm-gpu shim depends on the cpu extra's fbgemm-gpu-cpu.

    python tools/check_pins.py          # exit 1 naming each pin that does not resolve or disagrees

A pin like ``torchrec==1.6.0`` (never published) fails here, in CI, instead of on a user's GPU machine.
Uses ``pip index versions`` for CPython 3.12 on manylinux x86-64 (what the CUDA image runs).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ["--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:"]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.*+]*)$")
INSTALL_PIN = re.compile(r"\b(torch|torchrec|fbgemm-gpu)==([0-9][0-9A-Za-z.*+]*)")


def available(name: str, tries: int = 3) -> list[str]:
    for attempt in range(tries):
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, *TARGET],
                              capture_output=True, text=True, timeout=120)
        found = re.search(r"Available versions: (.*)", proc.stdout)
        if found:
            return [v.strip() for v in found.group(1).split(",")]
        if "No matching distribution" in proc.stdout + proc.stderr:
            return []
        time.sleep(2 * (attempt + 1))
    raise SystemExit(f"pip index versions {name}: no answer from the package index ({proc.stderr.strip()[-300:]})")


def matches(version: str, pin: str) -> bool:
    return version.startswith(pin[:-1]) if pin.endswith("*") else version == pin


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    problems, rows = [], []
    extras = project["optional-dependencies"]
    for extra in ("cpu", "gpu", "gpu-torch211"):
        for req in extras[extra]:
            m = PIN.match(req.replace(" ", ""))
            if not m:
                problems.append(f"pyproject.toml [{extra}] {req!r}: expected an exact pin name==version")
                continue
            name, pin = m.groups()
            versions = available(name)
            ok = any(matches(v, pin) for v in versions)
            rows.append(f"{extra:12} {name}=={pin}: {'found' if ok else 'MISSING'}")
            if not ok:
                problems.append(f"pyproject.toml [{extra}] {name}=={pin} is not on the index for CPython 3.12 "
                                f"manylinux x86-64 (it has {', '.join(versions[:8]) or 'none'}, ...)")
    gpu = dict(PIN.match(r.replace(" ", "")).groups() for r in extras["gpu"] if PIN.match(r.replace(" ", "")))
    cpu = dict(PIN.match(r.replace(" ", "")).groups() for r in extras["cpu"] if PIN.match(r.replace(" ", "")))
    for name in ("torch", "torchrec"):  # CI tests the CPU stack: the GPU image must run the same releases
        if cpu.get(name) != gpu.get(name):
            problems.append(f"pyproject.toml: the cpu extra pins {name}=={cpu.get(name)}, the gpu extra "
                            f"{name}=={gpu.get(name)}; use one release for both")
    shim = tomllib.loads((ROOT / "tools" / "fbgemm_gpu_shim" / "pyproject.toml").read_text())["project"]
    if shim["dependencies"] != [f"fbgemm-gpu-cpu=={cpu.get('fbgemm-gpu-cpu')}"]:
        problems.append(f"tools/fbgemm_gpu_shim depends on {shim['dependencies']}, the cpu extra on "
                        f"fbgemm-gpu-cpu=={cpu.get('fbgemm-gpu-cpu')}")
    for doc in ("Dockerfile", "README.md"):
        for name, pin in INSTALL_PIN.findall((ROOT / doc).read_text()):
            if name in gpu and not matches(pin, gpu[name]) and not matches(gpu[name].rstrip("*"), pin):
                problems.append(f"{doc} pins {name}=={pin}, pyproject.toml's gpu extra {name}=={gpu[name]}")
    print("\n".join(rows))
    if problems:
        raise SystemExit("\n".join(problems))
    print("every pin resolves; Dockerfile and README agree with the gpu extra")


if __name__ == "__main__":
    main()
