"""kvt's compiled parts, each with a pure-Python twin: whether one is in use
in this process, and why not (``kvt backends`` says so for each).

``KVT_NATIVE=0`` turns every one off, kvt's and its plugins' alike (CI runs
the whole suite so).  A part that did not build or load leaves its twin in
use with the reason, never an error: every path works without a compiler.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load", "summary", "ENABLED"]

#: False with ``KVT_NATIVE=0``: every compiled part off, the pure-Python twins run
ENABLED = os.environ.get("KVT_NATIVE", "1") != "0"


def load(module: str, dist: str, twin: str, needs: str | None = None) -> tuple[ModuleType | None, str]:
    """Import compiled ``module`` of distribution ``dist``: ``(module, why)``
    when it is in use, ``(None, why)`` when ``twin`` (what runs instead, e.g.
    "pure-Python post path") does; ``why`` is for operators.  ``needs``: a
    missing prerequisite, which keeps the twin in use (it says which)."""
    if not ENABLED:
        return None, f"KVT_NATIVE=0 forces the {twin}"
    if needs:
        return None, f"{module} needs {needs}"
    try:
        return importlib.import_module(module), f"C extension {module}"
    except ImportError as e:  # an install that skipped building extensions
        return None, f"{module} did not load ({e}); reinstall {dist} with gcc and the Python headers present"


def summary(module: ModuleType | None, why: str) -> str:
    """``"native (why)"`` or ``"python (why)"``: what ``load`` gave, in a line."""
    return f"{'native' if module is not None else 'python'} ({why})"
