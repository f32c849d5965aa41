"""Where the commands compose their configs from: the package ``ctr_conf`` once installed, else the checkout's ``conf/``.

``pip install .`` (and the editable install ``make`` does) maps ``conf/`` to the package ``ctr_conf``, so an installed
command composes from ``pkg://ctr_conf`` in any folder. A checkout that is not installed — the GPU machine's case,
where the stack is unpacked into a folder named by ``PYTHONPATH`` and the checkout is reached the same way
(docs/gpu.md) — has no such package: there the commands compose from the ``conf/`` folder beside this source, by its
absolute path (which Hydra's ``config_path`` takes as it is).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "ctr_conf"
CHECKOUT_CONF = Path(__file__).resolve().parents[2] / "conf"


def installed() -> bool:
    """True where ``ctr_conf`` can be imported (an installed wheel or an editable install)."""
    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except (ImportError, ValueError):
        return False


def config_path(group: str = "") -> str:
    """``hydra.main``'s ``config_path`` for ``conf/<group>`` (``""``: the top): ``pkg://ctr_conf[.group]``, or the
    checkout's folder where the package is not installed."""
    if installed() or not CHECKOUT_CONF.is_dir():
        return f"pkg://{PACKAGE}" + (f".{group}" if group else "")
    return str(CHECKOUT_CONF / group) if group else str(CHECKOUT_CONF)
