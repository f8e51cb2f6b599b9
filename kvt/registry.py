"""Backend discovery: the ``kvt.backends`` entry-point group.

Listing reads installed distributions' metadata only (``importlib.metadata``)
and never imports a plugin, so a broken plugin cannot break ``kvt backends``.
Loading goes through stevedore's ``DriverManager``, which imports only the
entry point asked for.  Every failure is a typed error:

* a name nobody declares      -> ``BackendNotFound`` listing what is installed
* a known kvt backend that is
  not installed               -> ``BackendNotFound`` naming the package
* the plugin fails to import  -> ``BackendLoadError`` saying why (cause chained)
* the entry point is not a
  ``Backend`` subclass, or its
  ``capabilities`` are not a
  ``Capabilities``            -> ``BackendLoadError``
* the class says it cannot
  run here                    -> ``BackendUnavailable`` (from ``create_backend``)

A plugin that calls ``sys.exit()`` while importing or probing is a load
failure like any other (it does not end the program).  Errors raised by
``load_backend`` and ``create_backend`` -- a configuration chose the backend --
end by naming the other installed backends.  ``probe`` gives up on a plugin
that has not imported and answered ``availability()`` within ``timeout``
seconds (``PROBE_TIMEOUT``): it is reported unusable, and the others are
still listed.

A plugin declares itself in its ``pyproject.toml``::

    [project.entry-points."kvt.backends"]
    mybackend = "my_package.backend:MyBackend"
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import msgspec
from stevedore import DriverManager, ExtensionManager
from stevedore.exception import MultipleMatches, NoMatches

from .backend import CORE_OPTIONS, Backend
from .errors import BackendLoadError, BackendNotFound, BackendUnavailable, ConfigError, InvalidArgument, KvtError
from .types import Availability, Capabilities

log = logging.getLogger(__name__)

__all__ = ["GROUP", "KNOWN", "PROBE_TIMEOUT", "BackendInfo", "BackendStatus", "list_backends",
           "load_backend", "probe", "create_backend", "own_options", "install_hint"]

#: the entry-point group every backend plugin declares
GROUP = "kvt.backends"

#: seconds ``probe`` waits for a plugin to import and answer ``availability()``
PROBE_TIMEOUT = 30.0

#: backends kvt ships as separate distributions: name -> distribution name
KNOWN: dict[str, str] = {
    "host": "kvt-host",
    "nixl": "kvt-nixl",
    "ucx": "kvt-ucx",
    "example": "kvt-example",
}


def install_hint(name: str) -> str:
    """The command that installs known backend ``name`` from a kvt checkout."""
    return f"pip install -e plugins/{name}"


@dataclass(frozen=True)
class BackendInfo:
    """An installed backend, as declared in its distribution's metadata."""

    name: str     #: entry point name, e.g. ``host``
    value: str    #: ``module:Class`` the entry point refers to
    dist: str     #: distribution that declares it, e.g. ``kvt-host``
    version: str  #: that distribution's version


@dataclass(frozen=True)
class BackendStatus:
    """What ``probe`` learnt about a backend by importing it.

    ``capabilities`` is ``None`` when the plugin could not be loaded; the
    reason is then in ``availability.reason``.  ``options``: the option keys
    it reads (with ``timeout``), ``None`` when undeclared or not loaded.
    """

    info: BackendInfo
    capabilities: Capabilities | None
    availability: Availability
    options: frozenset[str] | None = None
    post_path: str | None = None  #: the class's ``post_path``

    @property
    def usable(self) -> bool:
        return self.availability.usable


def _entry_points() -> list[md.EntryPoint]:
    return sorted(md.entry_points(group=GROUP), key=lambda ep: ep.name)


def _info(ep: md.EntryPoint) -> BackendInfo:
    dist = ep.dist
    return BackendInfo(ep.name, ep.value, dist.name if dist else "?", dist.version if dist else "?")


def list_backends() -> list[BackendInfo]:
    """Every installed backend, sorted by name.  Imports no plugin."""
    return [_info(ep) for ep in _entry_points()]


def _not_found(name: str, installed: list[str], chosen_by: str | None = None) -> BackendNotFound:
    have = ", ".join(sorted(set(installed))) or "none"
    by = f" (set by {chosen_by})" if chosen_by else ""
    if not isinstance(name, str):  # None, a number, a list...: no entry point is named by one
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        return BackendNotFound(f"a backend name must be a str such as 'host', got {type(name).__name__} {shown}{by}. "
                               f"Installed backends: {have}.")
    dist = KNOWN.get(name)
    if dist is None:
        close = difflib.get_close_matches(name, [*installed, *KNOWN], n=1)
        maybe = f" Did you mean {close[0]!r}?" if close else ""
        return BackendNotFound(f"no kvt backend named {name!r}{by}.{maybe} Installed backends: {have}. "
                               f"A backend is a distribution declaring a {GROUP!r} entry point.")
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        return BackendNotFound(f"backend {name!r}{by} is not installed; install the {dist!r} package "
                               f"(`{install_hint(name)}` from a kvt checkout). Installed backends: {have}.")
    return BackendNotFound(f"{dist} {version} is installed but declares no {GROUP!r} entry point {name!r}; "
                           f"reinstall it (`{install_hint(name)}`). Installed backends: {have}.")


def _find(name: str, chosen_by: str | None = None) -> BackendInfo:
    eps = _entry_points()
    mine = [ep for ep in eps if ep.name == name]
    if not mine:
        raise _not_found(name, [ep.name for ep in eps], chosen_by)
    if len(mine) > 1:
        who = ", ".join(f"{i.dist} {i.version} ({i.value})" for i in map(_info, mine))
        raise BackendLoadError(f"backend name {name!r} is declared by several distributions: {who}; "
                               "uninstall all but one")
    return _info(mine[0])


def _load(info: BackendInfo) -> type[Backend]:
    def failed(_manager: Any, _ep: Any, err: BaseException) -> None:
        raise BackendLoadError(f"backend {info.name!r} ({info.dist} {info.version}, {info.value}) "
                               f"failed to import: {type(err).__name__}: {err}") from err

    # stevedore keeps the entry points of a group in a process-wide cache;
    # drop ours so that what we load always matches what we just listed.
    ExtensionManager.ENTRY_POINT_CACHE.pop(GROUP, None)
    try:
        cls = DriverManager(GROUP, info.name, on_load_failure_callback=failed,
                            on_missing_entrypoints_callback=None).driver
    except (NoMatches, MultipleMatches) as e:  # its on-disk cache disagrees with the metadata
        raise BackendLoadError(f"stevedore could not load backend {info.name!r} ({info.value}): {e}; "
                               "its entry-point cache (~/.cache/python-entrypoints) may be stale") from e
    except SystemExit as e:  # stevedore reports Exceptions only; a plugin calling sys.exit() must not end us
        failed(None, None, e)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendLoadError(f"backend {info.name!r} ({info.dist} {info.version}): entry point "
                               f"{info.value} is {cls!r}, not a subclass of kvt.Backend")
    caps = cls.capabilities
    if not isinstance(caps, Capabilities):
        raise BackendLoadError(f"backend {info.name!r} ({info.dist} {info.version}): {cls.__name__}.capabilities "
                               f"is {type(caps).__name__}, not a kvt.Capabilities")
    try:  # Capabilities() does not check its fields' types: a set of strings, an unencodable option...
        msgspec.convert(msgspec.to_builtins(caps), Capabilities)
    except (msgspec.MsgspecError, TypeError, ValueError) as e:
        raise BackendLoadError(f"backend {info.name!r} ({info.dist} {info.version}): {cls.__name__}.capabilities "
                               f"are malformed: {e}") from None
    names = cls.option_names
    if names is not None and not (isinstance(names, (set, frozenset)) and all(isinstance(n, str) for n in names)):
        raise BackendLoadError(f"backend {info.name!r} ({info.dist} {info.version}): {cls.__name__}.option_names "
                               f"is {names!r}, not None or a set of option names (str)")
    if not (cls.post_path is None or isinstance(cls.post_path, str)):  # printed by kvt backends, in its JSON too
        raise BackendLoadError(f"backend {info.name!r} ({info.dist} {info.version}): {cls.__name__}.post_path "
                               f"is {type(cls.post_path).__name__}, not None or a str")
    return cls


def _others(name: str) -> str:
    names = sorted({i.name for i in list_backends()} - {name})
    return f"Other installed backends: {', '.join(names) or 'none'} (see `kvt backends`)."


def _naming_others(err: KvtError, name: str) -> KvtError:
    """``err`` with the other installed backends named: what a configuration could choose instead."""
    out = type(err)(f"{err}. {_others(name)}")
    out.__cause__ = err.__cause__
    return out


def load_backend(name: str, chosen_by: str | None = None) -> type[Backend]:
    """Import backend ``name`` and return its class (not an instance).
    ``chosen_by``: where the name came from (``Config.backend_source``), for
    the message when no backend has it."""
    info = _find(name, chosen_by)
    try:
        return _load(info)
    except BackendLoadError as e:
        raise _naming_others(e, name) from e.__cause__


def _probe(info: BackendInfo) -> BackendStatus:
    try:
        cls = _load(info)
    except BackendLoadError as e:
        return BackendStatus(info, None, Availability(False, str(e)))
    names = None if cls.option_names is None else cls.option_names | {"timeout"}
    return BackendStatus(info, cls.capabilities, _availability(cls), names, cls.post_path)


def probe(name: str, timeout: float = PROBE_TIMEOUT) -> BackendStatus:
    """Import backend ``name`` and ask whether it can run here.

    An installed backend that fails to load is reported, not raised: its
    status is unusable with the reason.  So is one that has not imported
    and answered ``availability()`` within ``timeout`` seconds (a plugin
    hanging there is left behind in a daemon thread).  An unknown name
    raises ``BackendNotFound``; a name declared by several distributions
    raises ``BackendLoadError``."""
    if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise InvalidArgument(f"probe timeout must be a positive number of seconds, got {timeout!r}")
    info = _find(name)
    done: list[BackendStatus] = []

    def run() -> None:
        try:
            done.append(_probe(info))
        except BaseException as e:  # noqa: BLE001 - a plugin bug kvt did not foresee: reported, not a thread traceback
            done.append(BackendStatus(info, None, Availability(
                False, f"backend {name!r} ({info.dist} {info.version}) failed while probed: {type(e).__name__}: {e}")))

    worker = threading.Thread(target=run, name=f"kvt-probe-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if done:
        return done[0]
    return BackendStatus(info, None, Availability(
        False, f"backend {name!r} ({info.dist} {info.version}, {info.value}) did not import and answer "
               f"availability() within {timeout:g}s: it hangs, or is very slow, on this machine"))


def _availability(cls: type[Backend]) -> Availability:
    try:
        avail = cls.availability()
    except (Exception, SystemExit) as e:  # a plugin bug must not break listing, nor end the program
        return Availability(False, f"{cls.__name__}.availability() raised {type(e).__name__}: {e}")
    if not (isinstance(avail, Availability) and isinstance(avail.usable, bool) and isinstance(avail.reason, str)):
        return Availability(False, f"{cls.__name__}.availability() returned {avail!r}, not an "
                                   "Availability(usable: bool, reason: str)")
    return avail


# how alike a shared key and one of the chosen backend's options must be to call it a typo: a
# letter or two off scores 0.89 and up, while the shipped backends' options score 0.73 at most
# against each other ("backends" / "backend_params"), so a key meant for another backend stays quiet
_TYPO = 0.8


def own_options(name: str, options: Mapping[str, Any], shared: Collection[str] = ()) -> dict[str, Any]:
    """Backend ``name``'s options: ``options`` without the keys in ``shared``
    (from a table serving every backend, ``Config.shared_options``) it does
    not read (logged: at WARNING for a key that looks like a misspelt option
    of this backend).  ``ConfigError`` for any other key it does not read."""
    cls = load_backend(name)
    own = dict(options)
    if cls.option_names is not None:
        names = sorted(cls.option_names | CORE_OPTIONS)
        ignored = sorted(k for k in own if k in shared and k not in names)
        misspelt = {k: close[0] for k in ignored
                    if (close := difflib.get_close_matches(str(k), names, n=1, cutoff=_TYPO))}
        for key, close in misspelt.items():  # most likely meant for this backend: say so where it shows
            log.warning("backend %r ignores shared option %r from the [options] table (did you mean %r?); "
                        "its options: %s", name, key, close, ", ".join(names))
        if others := [k for k in ignored if k not in misspelt]:  # keys for other backends: expected
            log.info("backend %r ignores shared options %s", name, others)
        own = {k: v for k, v in own.items() if k not in ignored}
    cls.check_options(own)
    return own


def create_backend(name: str, agent_name: str, options: Mapping[str, Any] | None = None,
                   shared: Collection[str] = (), chosen_by: str | None = None) -> Backend:
    """Load backend ``name`` and construct it for agent ``agent_name``.

    Keys of ``options`` the backend does not declare (``option_names``) are
    a ``ConfigError``, except those named in ``shared`` (they came from a
    table that serves every backend), which are dropped.  Raises
    ``BackendUnavailable`` with the reason when the backend cannot run on
    this machine or its constructor fails with a non-kvt error; ``chosen_by``
    as for ``load_backend``."""
    cls = load_backend(name, chosen_by)
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"options for backend {name!r} must be a mapping of option names to values, "
                          f"got {type(options).__name__}")
    options = own_options(name, options or {}, shared)
    avail = _availability(cls)
    if not avail.usable:
        raise BackendUnavailable(f"backend {name!r} cannot run on this machine: {avail.reason}. {_others(name)}")
    try:
        return cls(agent_name, options)
    except KvtError:
        raise
    except (Exception, SystemExit) as e:  # a constructor calling sys.exit() must not end the program either
        raise BackendUnavailable(f"backend {name!r} failed to start: {type(e).__name__}: {e}. "
                                 f"{_others(name)}") from e
