"""Batched memory copies: within this process, and into/out of another
process on this host (Linux cross-memory attach).

Rows are ``(n, 2)`` uint64 arrays of ``(address, length)`` — the layout of
``struct iovec`` — so batches go to the kernel without per-row Python work.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

_IOV_MAX = 1024
_BIG = 16 * 1024  # rows at least this long: memmove per row (user-space memcpy) beats the kernel copy here
_FEW = 16  # this few rows cost less as memmove calls than as one batched system call

_libc = ctypes.CDLL(None, use_errno=True)
_vm = {}
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name, None)
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        _vm[_name] = _fn

_self_cma = bool(_vm)  # turned off on first failure (e.g. seccomp forbids it)


def iov(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.column_stack([addrs, lengths]), dtype=np.uint64)


def cma(write: bool, pid: int, local: np.ndarray, remote: np.ndarray) -> None:
    """Copy between our ``local`` rows and ``remote`` rows of process ``pid``
    (pairwise equal lengths).  ``write`` sends local -> remote.  Raises
    ``OSError`` (ESRCH: the process is gone; EPERM: not allowed; EFAULT:
    address not mapped there) or ``BufferError`` on a short copy."""
    fn = _vm["process_vm_writev" if write else "process_vm_readv"]
    local, remote = np.ascontiguousarray(local, np.uint64), np.ascontiguousarray(remote, np.uint64)
    for s in range(0, len(local), _IOV_MAX):
        lo, ro = local[s:s + _IOV_MAX], remote[s:s + _IOV_MAX]
        want = int(lo[:, 1].sum())
        got = fn(pid, lo.ctypes.data, len(lo), ro.ctypes.data, len(ro), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got != want:
            raise BufferError(f"cross-memory copy moved {got} of {want} bytes")


def coalesce(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray):
    """Merge consecutive pairs contiguous on both sides into single runs."""
    if len(lengths) < 2:
        return dst, src, lengths
    cont = (dst[:-1] + lengths[:-1] == dst[1:]) & (src[:-1] + lengths[:-1] == src[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return dst[starts], src[starts], np.add.reduceat(lengths, starts)


def memcopy(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """Copy ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]`` within this process.

    Long runs go through ``memmove`` (user-space memcpy speed); the many
    short ones go to the kernel 1024 at a time as one batched copy, so a
    100,000-block batch costs ~100 system calls rather than 100,000 Python calls.
    """
    global _self_cma
    dst, src, lengths = coalesce(np.asarray(dst, np.uint64), np.asarray(src, np.uint64),
                                 np.asarray(lengths, np.uint64))
    big = lengths >= _BIG
    for d, s, n in zip(dst[big].tolist(), src[big].tolist(), lengths[big].tolist()):
        ctypes.memmove(d, s, n)
    small = ~big
    if not small.any():
        return
    d, s, n = dst[small], src[small], lengths[small]
    if _self_cma and len(n) > _FEW:
        try:
            cma(False, os.getpid(), iov(d, n), iov(s, n))
            return
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOSYS):
                raise
            _self_cma = False
    for dd, ss, nn in zip(d.tolist(), s.tolist(), n.tolist()):
        ctypes.memmove(dd, ss, nn)


def gather(rows: np.ndarray) -> np.ndarray:
    """Copy the ``(addr, len)`` rows into one new contiguous buffer."""
    lengths = rows[:, 1]
    out = np.empty(int(lengths.sum()), np.uint8)
    offs = np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.uint64))).astype(np.uint64)
    memcopy(np.uint64(out.ctypes.data) + offs, rows[:, 0], lengths)
    return out


def scatter(rows: np.ndarray, buf) -> None:
    """Copy a contiguous buffer out into the ``(addr, len)`` rows."""
    view = np.frombuffer(buf, np.uint8)
    lengths = rows[:, 1]
    if view.nbytes != int(lengths.sum()):
        raise BufferError(f"payload of {view.nbytes} bytes for rows totalling {int(lengths.sum())}")
    offs = np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.uint64))).astype(np.uint64)
    memcopy(rows[:, 0], np.uint64(view.ctypes.data) + offs, lengths)


def mmap_fd(path: str, size: int) -> tuple[int, int]:
    """Map a shared file read/write, pre-faulted; returns (address, size).

    ``size`` is what the peer claims; the file's own size (fstat) must hold
    it (``OSError`` EINVAL otherwise), so touching the mapping can never run
    past the end of the file (SIGBUS)."""
    if not os.readlink(path).startswith("/memfd:kvt"):  # only kvt's segments, never a file the process has open
        raise OSError(errno.EACCES, f"{path} is not a kvt shared segment")
    fd = os.open(path, os.O_RDWR)
    try:
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
