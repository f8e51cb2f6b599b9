"""The nixl backend's options, validated from kvt configuration.

See docs/backends/nixl.md for what each one does and which values were
measured best on these machines.
"""

from __future__ import annotations

from typing import Annotated, Any, Mapping

import msgspec
from kvt.errors import ConfigError

__all__ = ["NixlOptions", "OPTION_NAMES", "parse_options"]

_Name = Annotated[str, msgspec.Meta(min_length=1)]


class NixlOptions(msgspec.Struct, kw_only=True, frozen=True):
    #: NIXL backend plugins to create, in order of preference
    backends: Annotated[list[_Name], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["UCX"])
    #: worker threads of multi-threaded plugins (0 = the plugin's default)
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: NIXL's progress thread: completes transfers and receives notifications
    #: without the application polling.  Without it only our own NIXL calls progress.
    progress_thread: bool = True
    #: the progress thread's wait between polls when idle, in microseconds (NIXL rounds it
    #: up to milliseconds; it wakes at once on a UCX event).  0 = spin (nixl_agent's
    #: default), which costs a whole core per agent
    progress_delay_us: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1000
    #: with the progress thread on: after a ``get_notifs`` that found nothing, the next
    #: ones within this many microseconds answer from kvt without asking NIXL.  NIXL's
    #: call lets go of the GIL; an engine asking every step (thousands of times a second)
    #: would starve the process's other threads (kvt's handshakes), which CPython lets in
    #: only after 5 ms without a release.  0 = ask NIXL every time
    notif_quiet_us: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 10_000
    #: UCX_* environment settings applied while the agent's backends are
    #: created (e.g. ``{"UCX_TLS": "cma,tcp,self"}``), then restored
    ucx_env: dict[str, str | int] = {}
    #: per-plugin NIXL init parameters, e.g. ``{"UCX": {"ucx_error_handling_mode": "none"}}``
    backend_params: dict[_Name, dict[str, str | int]] = {}
    #: seconds a transfer may stay in progress before it turns to ERR (TransferTimeout)
    timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0


OPTION_NAMES = frozenset(NixlOptions.__struct_fields__)


def parse_options(options: Mapping[str, Any]) -> NixlOptions:
    """Validate ``options``; ``ConfigError`` names the bad field.  Other keys
    are left out (``Backend.__init__`` refuses unknown ones)."""
    try:
        opts = msgspec.convert({k: v for k, v in options.items() if k in OPTION_NAMES}, NixlOptions)
    except msgspec.ValidationError as e:
        raise ConfigError(f"nixl backend option: {e}") from None
    bad = [k for k in opts.ucx_env if not k.startswith("UCX_")]
    if bad:
        raise ConfigError(f"nixl backend option 'ucx_env' takes UCX_* variables only, got {bad}; "
                          "set other environment variables before starting the process")
    return opts
