"""Everything that touches ucxx directly: loading it, buffers over raw
addresses, CUDA detection, and mapping its exceptions into kvt's tree.

ucxx is imported lazily (``load()``) so that ``kvt backends`` can import this
plugin and say *why* it is unusable when ucxx is missing or broken.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
from kvt.errors import (BackendUnavailable, PeerDisconnected, RemoteRejected, TransferError,
                        TransferTimeout)

__all__ = ["load", "load_error", "host_view", "Buffer", "cuda_devices", "to_kvt"]


def _import() -> ModuleType:
    # ucxx sets UCX_MEMTYPE_CACHE for old UCX releases; the bundled UCX warns
    # on every context creation that it does not know it.  Silence only that.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as ucx_api  # noqa: PLC0415 - lazy on purpose
    return ucx_api


@lru_cache(maxsize=1)
def load_error() -> str:
    """Why ucxx cannot be used here ('' if it can)."""
    try:
        _import()
    except ImportError as e:
        return f"ucxx is not importable ({e}); install it with `pip install ucxx-cu12`"
    except Exception as e:  # a broken native install raises anything at import
        return f"importing ucxx failed: {type(e).__name__}: {e}"
    return ""


def load() -> ModuleType:
    """The ``ucxx._lib.libucxx`` module; ``BackendUnavailable`` if it cannot load."""
    reason = load_error()
    if reason:
        raise BackendUnavailable(reason)
    return _import()


class _Interface:
    """Carrier of an array interface (host) or CUDA array interface (device)."""

    __slots__ = ("__array_interface__", "__cuda_array_interface__")


def _address_space() -> np.ndarray:
    # One byte array over the whole address space: a view of any range is a
    # cheap slice of it (building an array from an interface dict costs ~10 us).
    # It starts at the first page, which is never mapped: numpy reads a data
    # pointer of 0 as "allocate".  Nothing here reads memory by itself.
    obj = _Interface()
    obj.__array_interface__ = {"data": (_BASE, False), "shape": (1 << 62,), "typestr": "|u1", "version": 3}
    return np.asarray(obj)


_BASE = 4096
_SPACE = _address_space()


def host_view(addr: int, shape: tuple[int, ...] | int, dtype: Any = np.uint8,
              strides: tuple[int, ...] | None = None) -> np.ndarray:
    """A numpy array over raw host memory at ``addr`` (no copy, no ownership).
    Callers only pass addresses inside registered memory, which the
    registration keeps alive."""
    return np.ndarray(shape, dtype, buffer=_SPACE, offset=int(addr) - _BASE, strides=strides)


def _cuda_view(addr: int, nbytes: int) -> _Interface:
    obj = _Interface()
    obj.__cuda_array_interface__ = {"data": (int(addr), False), "shape": (int(nbytes),),
                                    "typestr": "|u1", "strides": None, "version": 2}
    return obj


def Buffer(ucx_api: ModuleType, addr: int, nbytes: int, cuda: bool = False) -> Any:  # noqa: N802 - a factory
    """A ucxx ``Array`` over ``nbytes`` at ``addr`` (host or CUDA memory)."""
    from ucxx._lib.arr import Array  # noqa: PLC0415 - ucxx is loaded by now

    return Array(_cuda_view(addr, nbytes) if cuda else host_view(addr, nbytes))


@lru_cache(maxsize=1)
def cuda_devices() -> int:
    """How many CUDA devices the driver reports (0 without a driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


# ucxx's exception names (attributes of its module) -> kvt error class
_PEER_GONE = ("UCXConnectionResetError", "UCXEndpointTimeoutError", "UCXUnreachableError",
              "UCXNotConnectedError", "UCXFirstLinkFailureError", "UCXLastLinkFailureError",
              "UCXFirstEndpointFailureError", "UCXLastEndpointFailureError", "UCXCloseError",
              "UCXIOError")
_NAMES = {**dict.fromkeys(_PEER_GONE, PeerDisconnected),
          "UCXTimedOutError": TransferTimeout, "UCXRejectedError": RemoteRejected}


@lru_cache(maxsize=1)
def _classes() -> tuple[tuple[type, type[TransferError]], ...]:
    api = load()
    return tuple((getattr(api, name), cls) for name, cls in _NAMES.items() if hasattr(api, name))


def to_kvt(exc: BaseException, what: str) -> TransferError:
    """The kvt ``TransferError`` for a ucxx (or other native) exception,
    chained to it."""
    cls = next((k for native, k in _classes() if isinstance(exc, native)), TransferError)
    err = cls(f"{what}: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
