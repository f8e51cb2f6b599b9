"""The host backend's memory operations: batched copies within this
process (``kvt.memcopy``: native engine or its fallback), into and out of
another process on this host (Linux cross-memory attach), and mapping a
peer's shared segment.

Rows are ``(n, 2)`` uint64 arrays of ``(address, length)`` — the layout of
``struct iovec`` — so batches go to the kernel without per-row Python work.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

from kvt.memcopy import copy as memcopy, gather, process_vm as cma, scatter

__all__ = ["memcopy", "gather", "scatter", "cma", "mmap_fd", "munmap"]

_libc = ctypes.CDLL(None, use_errno=True)


def mmap_fd(path: str, size: int) -> tuple[int, int]:
    """Map a shared file read/write, pre-faulted; returns (address, size).

    ``size`` is what the peer claims; the file's own size (fstat) must hold
    it (``OSError`` EINVAL otherwise) and the file must be sealed against
    shrinking (``kvt.memory`` seals its segments; ``OSError`` EACCES
    otherwise), so touching the mapping can never run past the end of the
    file (SIGBUS), then or later."""
    if not os.readlink(path).startswith("/memfd:kvt"):  # only kvt's segments, never a file the process has open
        raise OSError(errno.EACCES, f"{path} is not a kvt shared segment")
    fd = os.open(path, os.O_RDWR)
    try:
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise OSError(errno.EACCES, f"{path} is not sealed against shrinking")
        if not 0 < size <= os.fstat(fd).st_size:
            raise OSError(errno.EINVAL, f"segment claims {size} bytes, the file holds {os.fstat(fd).st_size}")
        addr = _mmap(None, size, 0x3, 0x01 | 0x8000, fd, 0)  # PROT_READ|WRITE, MAP_SHARED|POPULATE
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return addr, size


def munmap(addr: int, size: int) -> None:
    _munmap(addr, size)


_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
