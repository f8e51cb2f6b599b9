"""Capabilities as test requirements (in the manner of SQLAlchemy's suite
requirements): a test names what it needs, and runs only where the backend
declares it and this machine has it.

A need is a ``Capabilities`` flag (``local``, ``remote``, ``cross_host``,
``notifications``), an operation (``READ``, ``WRITE``) or a memory kind
(``DRAM``, ``VRAM``, ``DEVICE``).  An unmet need skips the test with one of
two reasons, so a report tells "does not claim it" from "claims it, cannot
show it here"::

    not declared: ExampleBackend does not declare remote (Capabilities.remote is False)
    declared, unavailable here: VRAM: no CUDA device (torch.cuda.is_available() is False)

Declare what a test needs with the ``requires`` marker::

    @requires("remote", "notifications")
    def test_...(self, backend, peer): ...
"""

from __future__ import annotations

import pytest
from kvt.types import Capabilities, MemKind, Op

from .buffers import unavailable_reason

__all__ = ["NOT_DECLARED", "UNAVAILABLE", "MARKER", "NEEDS", "requires", "unmet", "check"]

NOT_DECLARED = "not declared"
UNAVAILABLE = "declared, unavailable here"
MARKER = "kvt_requires"
_FLAGS = ("local", "remote", "cross_host", "notifications", "stops_on_err")
NEEDS = (*_FLAGS, *(o.value for o in Op), *(k.value for k in MemKind))

#: ``@requires("remote", ...)``: the marker every suite uses
requires = getattr(pytest.mark, MARKER)


def unmet(backend_cls: type, need: str | Op | MemKind) -> str | None:
    """The skip reason if ``backend_cls`` cannot satisfy ``need``, else None."""
    need = getattr(need, "value", need)
    caps: Capabilities = backend_cls.capabilities
    who = backend_cls.__name__
    if need in _FLAGS:
        if not getattr(caps, need):
            return f"{NOT_DECLARED}: {who} does not declare {need} (Capabilities.{need} is False)"
        return None
    if need in Op.__members__:
        if Op(need) not in caps.ops:
            return f"{NOT_DECLARED}: {who} does not declare the {need} operation (Capabilities.ops)"
        return None
    if need in MemKind.__members__:
        kind = MemKind(need)
        if kind not in caps.mem_kinds:
            return f"{NOT_DECLARED}: {who} does not declare {need} memory (Capabilities.mem_kinds)"
        why = unavailable_reason(kind)
        return f"{UNAVAILABLE}: {need}: {why}" if why else None
    raise ValueError(f"unknown requirement {need!r}; use one of {NEEDS}")


def check(backend_cls: type, *needs: str | Op | MemKind) -> None:
    """Skip the running test at the first unmet need."""
    for need in needs:
        reason = unmet(backend_cls, need)
        if reason:
            pytest.skip(reason)
