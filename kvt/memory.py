"""Host memory that other processes on this host can map.

``empty(...)`` allocates in a memfd-backed shared segment instead of the
private heap.  Registering such memory lets a same-host peer map it once and
copy with plain ``memcpy`` (the host backend's fastest path) instead of a
kernel copy.  Segments are found by address, so any view into one qualifies.
A segment lives as long as any array or tensor viewing it; its file
descriptor closes with it, so nothing leaks when a process dies.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

from .errors import InvalidArgument
from .types import Descs

__all__ = ["empty", "empty_tensor", "segments_of"]

_lock = threading.Lock()
_segments: dict[int, tuple[int, int]] = {}  # base address -> (fd, size)


def _forget(addr: int, fd: int) -> None:
    with _lock:
        _segments.pop(addr, None)
    os.close(fd)


def empty(shape: Any, dtype: Any = np.uint8) -> np.ndarray:
    """A zero-filled, pre-faulted numpy array in a new shared segment."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < 0:
        raise InvalidArgument(f"negative size for shape {shape}")
    size = max(nbytes, 1)
    fd = os.memfd_create("kvt", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        # MAP_POPULATE pre-faults the pages so the first transfer is not a page-fault storm.
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:
        os.close(fd)
        raise
    flat = np.frombuffer(mm, np.uint8)
    addr = flat.ctypes.data
    with _lock:
        _segments[addr] = (fd, size)
    weakref.finalize(mm, _forget, addr, fd)
    return flat[:nbytes].view(dtype).reshape(shape)


def empty_tensor(shape: Any, dtype: Any = None):
    """Like :func:`empty` but returns a CPU torch tensor (``torch`` dtype)."""
    import torch

    dtype = dtype or torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = empty((int(np.prod(shape, dtype=np.int64)) * itemsize,), np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def segments_of(descs: Descs) -> np.ndarray:
    """The shared segments that contain rows of ``descs``: an ``(m, 3)``
    uint64 array of ``(base address, size, fd)``."""
    with _lock:
        segs = np.array([(a, s, fd) for a, (fd, s) in _segments.items()], dtype=np.uint64).reshape(-1, 3)
    if not len(segs) or not len(descs):
        return segs[:0]
    where = descs.locate(Descs(np.column_stack([segs[:, 0], segs[:, 1], np.zeros(len(segs), np.uint64)])))
    hit = np.unique(where[where >= 0])
    return segs[hit]
