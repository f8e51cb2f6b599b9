"""The backend under test: its class, how to rebuild it in a peer process,
and what to call it in reports.

A target is named by an installed entry point (``"host"``) or given as a
``Backend`` subclass (a plugin's own tests, or a test double).  A peer
process rebuilds it from ``spec``: ``ep:NAME`` or ``module:QualName``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvt import registry
from kvt.backend import Backend
from kvt.errors import BackendLoadError, BackendUnavailable, KvtError
from kvt.types import Availability, MemKind, Op

__all__ = ["Target", "DEFAULT_OPTIONS", "build"]

#: options every backend under test gets unless the run overrides them
DEFAULT_OPTIONS: dict[str, Any] = {"timeout": 10.0}

_names = itertools.count(1)


def _load(spec: str) -> type[Backend]:
    if spec.startswith("ep:"):
        return registry.load_backend(spec[3:])
    module, _, qual = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise BackendLoadError(f"cannot import backend class {spec!r}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise BackendLoadError(f"{spec!r} is {obj!r}, not a kvt.Backend subclass")
    return obj


def _availability(cls: type[Backend]) -> Availability:
    try:
        return cls.availability()
    except Exception as e:  # a plugin bug must show as a reason, not a crash
        return Availability(False, f"{cls.__name__}.availability() raised {type(e).__name__}: {e}")


def build(spec: str, agent_name: str, options: Mapping[str, Any]) -> Backend:
    """Construct the backend ``spec`` names (used by peer processes)."""
    cls = _load(spec)
    avail = _availability(cls)
    if not avail.usable:
        raise BackendUnavailable(f"{spec} cannot run here: {avail.reason}")
    return _construct(cls, agent_name, options)


def _construct(cls: type[Backend], agent_name: str, options: Mapping[str, Any]) -> Backend:
    try:
        return cls(agent_name, dict(options))
    except KvtError:
        raise
    except Exception as e:
        raise BackendUnavailable(f"{cls.__name__}({agent_name!r}) failed: {type(e).__name__}: {e}") from e


def _version(cls: type[Backend], ep_name: str | None) -> tuple[str, str]:
    """(distribution, version) of the backend's package, best effort."""
    value = f"{cls.__module__}:{cls.__qualname__}"
    for info in registry.list_backends():
        if info.name == ep_name or info.value == value:
            return info.dist, info.version
    top = cls.__module__.split(".")[0]
    for dist in md.packages_distributions().get(top, []):
        return dist, md.version(dist)
    return top, str(getattr(importlib.import_module(top), "__version__", "unversioned"))


@dataclass(frozen=True)
class Target:
    cls: type[Backend]
    spec: str                       #: how a peer process rebuilds it
    label: str                      #: entry-point name, or the class name
    dist: str
    version: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(cls, target: type[Backend] | str, options: Mapping[str, Any] | None = None) -> "Target":
        """Load ``target`` (entry-point name or class).  Raises kvt errors."""
        if isinstance(target, str):
            klass, spec, label, ep = registry.load_backend(target), f"ep:{target}", target, target
        else:
            klass, spec, label, ep = target, f"{target.__module__}:{target.__qualname__}", target.__name__, None
        dist, version = _version(klass, ep)
        return cls(klass, spec, label, dist, version, {**DEFAULT_OPTIONS, **(options or {})})

    @property
    def caps(self):
        return self.cls.capabilities

    @property
    def timeout(self) -> float:
        return float(self.options["timeout"])

    def availability(self) -> Availability:
        return _availability(self.cls)

    def create(self, role: str = "agent", **overrides: Any) -> Backend:
        """A new instance with a unique agent name; ``overrides`` replace options."""
        name = f"kvt-conformance-{role}-{os.getpid()}-{next(_names)}"
        return _construct(self.cls, name, {**self.options, **overrides})

    def describe(self) -> dict[str, Any]:
        """Plain data for reports."""
        c = self.caps
        return {"backend": self.label, "spec": self.spec, "distribution": self.dist, "version": self.version,
                "options": self.options,
                "capabilities": {"mem_kinds": [k.value for k in MemKind if k in c.mem_kinds],
                                 "ops": [o.value for o in Op if o in c.ops],
                                 "notifications": c.notifications, "local": c.local, "remote": c.remote,
                                 "cross_host": c.cross_host, "max_notif_bytes": c.max_notif_bytes,
                                 "cross_host_options": c.cross_host_options, "owner_check": c.owner_check},
                "ran": self.ran()}

    def ran(self) -> dict[str, str]:
        """What could run here of what is declared: cross-host, and memory kinds."""
        from .buffers import unavailable_reason

        c = self.caps
        out = {"cross_host": (f"declared: tested between processes with cross_host_options {c.cross_host_options}"
                              if c.cross_host else "not declared: not tested")}
        for kind in MemKind:
            if kind in c.mem_kinds:
                why = unavailable_reason(kind)
                out[kind.value] = f"declared, unavailable here: {why}" if why else "declared, tested"
        return out

    def header(self) -> str:
        d = self.describe()
        caps = d["capabilities"]
        flags = [f for f in ("notifications", "local", "remote", "cross_host") if caps[f]]
        return (f"kvt backend: {self.label} ({self.dist} {self.version}, {self.spec}); declares "
                f"memory {' '.join(caps['mem_kinds'])}, ops {' '.join(caps['ops'])}, "
                f"{', '.join(flags) or 'no peers/notifications'}, max_notif_bytes={caps['max_notif_bytes']}, "
                f"owner_check={caps['owner_check'] or '-'}; options {self.options}; "
                + "; ".join(f"{k}: {v}" for k, v in d["ran"].items()))
