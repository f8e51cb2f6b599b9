"""Adapters that plug kvt's engine connector into inference engines.

Each adapter imports its engine, so it is imported only where that engine
is installed: ``import kvt.integrations.vllm`` without vLLM raises
``IntegrationUnavailable`` (an ``ImportError`` and a ``KvtError``) saying
what to install.  ``available(name)`` asks without importing anything.
"""

from __future__ import annotations

import importlib.util

from ..errors import KvtError

__all__ = ["IntegrationUnavailable", "available", "require"]

#: integration name -> (module it needs, how to get it)
ENGINES = {"vllm": ("vllm", "pip install vllm")}


class IntegrationUnavailable(KvtError, ImportError):
    """The engine an integration adapts is not installed."""


def available(name: str) -> bool:
    """Whether the engine behind integration ``name`` is importable (imports nothing)."""
    module, _ = ENGINES[name]
    return importlib.util.find_spec(module) is not None


def require(name: str) -> None:
    """``IntegrationUnavailable`` unless integration ``name``'s engine is installed."""
    module, hint = ENGINES[name]
    if not available(name):
        raise IntegrationUnavailable(f"kvt.integrations.{name} adapts {module}, which is not installed here; "
                                     f"`{hint}` first (kvt.connector itself works without it)", name=module)
