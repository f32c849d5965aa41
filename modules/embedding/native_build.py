"""C sources of this package compiled on first use and loaded with :mod:`ctypes` (``row_init.c``,
``ssd_tier/cache_loops.c``), and the address checks every call into them makes.

A source is compiled once per machine with the system's C compiler (``$CC``, else ``cc``; plain C11, no Python
or torch headers: well under a second) into ``$XDG_CACHE_HOME/ctr-pipeline`` (else ``~/.cache/ctr-pipeline``),
named by the source's and the flags' hash, under a temporary name then renamed (ranks compiling at once each
get a whole library). Every source has a numpy or torch twin that computes the same thing — the reference its
tests compare it with, and what runs where no compiler is found (:func:`available` warns once per source).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

# -ffp-contract=off: no a·b + c fused into one rounding, so float code rounds as its numpy twin does;
# -fno-trapping-math: both sides of a float select may be computed (vectorised), the same values
FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
log = logging.getLogger(__name__)


class NativeError(RuntimeError):
    """A C source could not be built."""


def library_path(source: Path) -> Path:
    code = source.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctr-pipeline"
    return root / f"{source.stem}-{hashlib.sha256(code).hexdigest()[:16]}.so"


@lru_cache(maxsize=None)
def library(source: Path) -> ctypes.CDLL:
    """``source`` compiled (on first use) and loaded; :class:`NativeError` if no compiler can build it."""
    path = library_path(source)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        cmd = [os.environ.get("CC", "cc"), *FLAGS, str(source), "-o", str(temp), "-lm"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            temp.unlink(missing_ok=True)
            raise NativeError(f"{' '.join(cmd)}: {getattr(e, 'stderr', '') or e}".strip()) from e
        os.replace(temp, path)
    return ctypes.CDLL(str(path))


@lru_cache(maxsize=None)
def available(source: Path, fallback: str) -> bool:
    """Whether ``source`` can be used here (else, once, a warning that ``fallback`` runs instead)."""
    try:
        library(source)
        return True
    except (NativeError, OSError) as e:
        log.warning("%s could not be built (%s): %s", source.name, e, fallback)
        return False


def ptr(t: torch.Tensor | np.ndarray, dtype: torch.dtype | np.dtype | None = None) -> ctypes.c_void_p:
    """The address of ``t``'s first element; refused unless it is contiguous (and of ``dtype``, if given): the C
    reads and writes it as one flat array of that type."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"the C loops take contiguous {dtype or t.dtype} arrays (got {t.dtype}, {t.strides})")
        return ctypes.c_void_p(t.ctypes.data)
    if not t.is_contiguous() or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"the C loops take contiguous {dtype or t.dtype} tensors (got {t.dtype}, {t.stride()})")
    return ctypes.c_void_p(t.data_ptr())
