"""A checkpoint's integrity: ``manifest.json`` lists every file's size and SHA-256, written by rank 0 once
every rank has finished; :func:`verify_checkpoint` tells whether the directory still matches it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """``manifest.json``: size and SHA-256 of every other file of a finished checkpoint directory."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify_checkpoint(folder: str | os.PathLike) -> list[str]:
    """What is wrong with a checkpoint directory against its manifest (empty: intact)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return [f"{manifest} is missing"]
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{manifest} is unreadable ({e})"]
    problems = []
    for name, want in entries.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{p} is missing")
        elif p.stat().st_size != want["size"]:
            problems.append(f"{p} has {p.stat().st_size:,} bytes, the manifest says {want['size']:,}")
        elif sha256(p) != want["sha256"]:
            problems.append(f"{p} does not match its checksum")
    return problems
