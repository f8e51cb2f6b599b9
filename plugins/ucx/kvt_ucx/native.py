"""Loading kvt_ucx._ucp (the compiled UCP binding) and mapping UCX status
codes into kvt's error tree.

The binding links against the libucx wheel's ``libucp``; ``libucx.load_library()``
loads those libraries first so the dynamic loader finds them by soname.  It is
imported lazily so that ``kvt backends`` can say *why* the backend is unusable.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import ModuleType

from kvt.errors import BackendUnavailable, PeerDisconnected, RemoteRejected, TransferError, TransferTimeout

__all__ = ["load", "load_error", "error_of", "INPROGRESS", "EXITED"]

INPROGRESS = 1  # UCS_INPROGRESS
EXITED = 2  # Xfer.status(pidfd): done, but the same-host peer behind pidfd has exited


def _import() -> ModuleType:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import libucx  # noqa: PLC0415 - lazy on purpose

    libucx.load_library()
    from . import _ucp  # noqa: PLC0415

    return _ucp


@lru_cache(maxsize=1)
def load_error() -> str:
    """Why the UCP binding cannot be used here ('' if it can)."""
    try:
        _import()
    except ImportError as e:
        return (f"the UCP binding kvt_ucx._ucp or libucx is not importable ({e}); "
                "reinstall with `pip install -e plugins/ucx` (it compiles against the libucx-cu12 wheel)")
    except Exception as e:  # a broken native install raises anything at import
        return f"loading UCX failed: {type(e).__name__}: {e}"
    return ""


def load() -> ModuleType:
    """The ``kvt_ucx._ucp`` module; ``BackendUnavailable`` if it cannot load."""
    reason = load_error()
    if reason:
        raise BackendUnavailable(reason)
    return _import()


def _is_peer_gone(status: int) -> bool:
    # connection reset, unreachable, not connected, I/O error, link and endpoint failures
    return status in (-3, -6, -24, -25) or -89 <= status <= -40


def error_of(status: int, what: str) -> TransferError:
    """The kvt error for a UCX status code (< 0)."""
    from . import _ucp  # noqa: PLC0415 - loaded by now

    text = f"{what}: {_ucp.status_string(status)} (UCX status {status})"
    if _is_peer_gone(status):
        return PeerDisconnected(text)
    if status == -20:
        return TransferTimeout(text)
    if status == -23:
        return RemoteRejected(text)
    return TransferError(text)
