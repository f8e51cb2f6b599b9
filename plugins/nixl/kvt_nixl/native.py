"""Everything that touches the ``nixl`` package directly, except the verbs:
importing it lazily, asking whether it can run here, turning its
exceptions into kvt errors, and creating an agent.

The ``nixl`` import is deferred so that ``kvt backends`` can load this
plugin and report *why* NIXL is unusable instead of failing to import it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
from functools import lru_cache
from typing import Any, Iterator, Mapping

from kvt.errors import BackendUnavailable, ConfigError, KvtError, PeerDisconnected, TransferError
from kvt.types import Availability

__all__ = ["api", "availability", "cuda_present", "translate", "status_name", "temp_env",
           "new_agent", "INIT_AGENT"]

#: the name NIXL wants for the initiator's own side of a prepped transfer
INIT_AGENT = "NIXL_INIT_AGENT"


@lru_cache(maxsize=1)
def _import() -> tuple[Any, BaseException | None]:
    try:
        from nixl import _api
    except Exception as e:  # ImportError, or a broken wheel raising anything
        return None, e
    # nixl logs every agent creation at INFO on stdout; keep stdout for the
    # program unless the operator asked for NIXL's logs.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api, None


def api() -> Any:
    """The ``nixl._api`` module (callers checked ``availability`` first)."""
    mod, err = _import()
    if mod is None:
        raise ImportError(f"nixl is not importable: {err}") from err
    return mod


@lru_cache(maxsize=1)
def availability() -> Availability:
    """Usable, or exactly why not: nixl missing, or no UCX plugin found."""
    mod, err = _import()
    if mod is None:
        return Availability(False, f"the 'nixl' package cannot be imported ({type(err).__name__}: {err}); "
                                   "install it with `pip install nixl` (or `pip install -e plugins/nixl`)")
    nixl_log = logging.getLogger("nixl")
    level = nixl_log.level
    nixl_log.setLevel(logging.CRITICAL)  # "no plugins" is logged as an error; we report it ourselves
    try:  # an agent without backends only lists plugins: cheap, no network
        probe = mod.nixl_agent(f"kvt-nixl-probe-{os.getpid()}",
                               mod.nixl_agent_config(enable_prog_thread=False, backends=[]))
        plugins = list(probe.get_plugin_list())
    except RuntimeError as e:
        if "No plugins" not in str(e):  # nixl_agent refuses to exist without any plugin
            return Availability(False, f"nixl imported but could not create an agent: {e}")
        plugins = []
    except Exception as e:
        return Availability(False, f"nixl imported but could not create an agent ({type(e).__name__}: {e}); "
                                   "check NIXL_PLUGIN_DIR and the nixl installation")
    finally:
        nixl_log.setLevel(level)
    if "UCX" not in plugins:
        where = os.environ.get("NIXL_PLUGIN_DIR", "the nixl wheel's plugin directory")
        return Availability(False, f"nixl found no UCX plugin in {where} (plugins found: "
                                   f"{', '.join(plugins) or 'none'}); reinstall nixl or fix NIXL_PLUGIN_DIR")
    return Availability(True)


def cuda_present() -> bool:
    """Whether this machine shows an NVIDIA GPU to this process.

    Read from the driver's /proc entries rather than by initialising CUDA:
    this runs at import, and initialising CUDA before a ``fork`` breaks the
    children."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/proc/driver/nvidia/gpus/*"))


def status_name(exc: BaseException) -> str:
    """``NIXL_ERR_NOT_FOUND`` for a ``nixlNotFoundError``; the class name for others."""
    text = str(exc)
    return text if text.startswith("NIXL_") else type(exc).__name__


def translate(exc: BaseException, what: str, default: type[KvtError],
              overrides: Mapping[str, type[KvtError]] | None = None) -> KvtError:
    """The kvt error for a native exception raised while doing ``what``.

    A remote disconnect is always ``PeerDisconnected``; a cancellation a
    ``TransferError``; other NIXL statuses map through ``overrides`` (keyed
    by status name, e.g. ``"NIXL_ERR_NOT_FOUND"``), else to ``default``.
    kvt errors pass through unchanged.  Use as ``raise translate(...) from e``."""
    if isinstance(exc, KvtError):
        return exc
    status = status_name(exc)
    if status == "NIXL_ERR_REMOTE_DISCONNECT":
        cls: type[KvtError] = PeerDisconnected
    elif status == "NIXL_ERR_CANCELED":
        cls = TransferError
    else:
        cls = (overrides or {}).get(status, default)
    detail = status if status == str(exc) else f"{status}: {exc}"
    return cls(f"{what} failed: NIXL reported {detail}")


@contextlib.contextmanager
def temp_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` for the duration (UCX reads its settings when a backend is
    created), then restore, so one agent's UCX settings do not leak into
    other agents or libraries of the process."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: the init-parameter key a plugin takes its thread count under (as nixl_agent does)
_THREAD_KEYS = {"GDS_MT": "thread_count", "UCCL": "num_cpus"}


def new_agent(name: str, backends: list[str], params: Mapping[str, Mapping[str, str]],
              num_threads: int, progress_thread: bool, env: Mapping[str, str], progress_delay_us: int = 0) -> Any:
    """A ``nixl_agent`` with ``backends`` created from ``params``.

    The agent is created without backends and each is then created
    explicitly, so that per-backend init parameters (e.g. UCX's
    ``ucx_error_handling_mode``) reach NIXL; nixl_agent_config only carries
    a thread count.

    ``NIXL_THREAD_SYNC_NONE``, as ``nixl_agent`` defaults to (and engines
    use): NIXL's ``STRICT`` mode cost ~4 us per request here (a 4 KiB READ
    took 11 us instead of 7, docs/performance.md), more than all of kvt.
    kvt's callers may post and poll from several threads, so the backend
    serializes its own calls into NIXL with a lock instead (NIXL releases
    the GIL in some calls, e.g. ``postXferReq``).  ``progress_delay_us``:
    see ``_progress_delay``."""
    mod = api()
    conf = mod.nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                 sync_mode=mod.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
    with temp_env(env):
        try:
            with _progress_delay(mod, progress_delay_us if progress_thread else 0):
                agent = mod.nixl_agent(name, conf)
        except Exception as e:
            raise translate(e, f"creating NIXL agent {name!r}", BackendUnavailable) from e
        missing = [b for b in backends if b not in agent.get_plugin_list()]
        if missing:
            raise ConfigError(f"nixl backend option 'backends': NIXL has no plugin {missing}; "
                              f"available here: {sorted(agent.get_plugin_list())}")
        for b in backends:
            init = {_THREAD_KEYS.get(b, "num_threads"): str(num_threads)} if num_threads else {}
            init.update(params.get(b, {}))
            try:
                agent.create_backend(b, init)
            except Exception as e:
                raise translate(e, f"creating NIXL backend {b} (init parameters {init}, UCX settings "
                                   f"{dict(env)}; UCX explains on stderr)", BackendUnavailable,
                                {"NIXL_ERR_INVALID_PARAM": ConfigError}) from e
    return agent


_AGENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _progress_delay(mod: Any, delay_us: int) -> Iterator[None]:
    """Agents created meanwhile get ``pthrDelay = delay_us``.

    ``nixl_agent`` hard-codes ``pthrDelay = 0``, and NIXL's UCX progress
    thread polls its workers' event fds with a timeout of ``pthrDelay``
    rounded up to milliseconds: 0 makes it spin, a whole core per agent
    (measured: 94% of a core idle), which on a small machine is taken from
    the engine's own compute.  With a delay it sleeps in ``poll`` until UCX
    signals an event (or the delay passes, NIXL's guard against missed
    wake-ups).  The bindings are swapped only for the ``nixl_agent`` call,
    under a lock, and restored after."""
    real = getattr(mod, "nixlBind", None)
    if not delay_us or real is None or not hasattr(real.nixlAgentConfig(), "pthrDelay"):
        if delay_us:
            logging.getLogger(__name__).warning("this nixl has no pthrDelay; its progress thread busy-polls")
        yield
        return

    class _Bindings:
        """The bindings module, except that agents get our delay."""

        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
            config.pthrDelay = int(delay_us)
            return real.nixlAgent(name, config)

    with _AGENT_LOCK:
        mod.nixlBind = _Bindings()
        try:
            yield
        finally:
            mod.nixlBind = real
