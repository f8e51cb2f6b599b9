"""Batched memory copies by address: the data path of same-host transfers.

``copy(dst, src, lengths)`` copies ``lengths[i]`` bytes from address
``src[i]`` to ``dst[i]``.  The native engine (``kvt._copy``, C, built by pip
from source) runs the whole batch with the GIL released, merges runs
contiguous on both sides, and splits large requests across threads.  The
pure-Python fallback (``KVT_NATIVE=0`` forces it; also used when the
extension did not build) does one ``memmove`` per long run and hands many
short rows to the kernel in batches (``process_vm_readv`` on our own pid).

Callers vouch that every address is mapped and writable where needed: a
wrong address crashes the process, as a wrong pointer does in C.

Tuning (environment): ``KVT_COPY_THREADS`` (threads for one large request;
default ``min(4, cpus)``), ``KVT_COPY_SPLIT_MIB`` (smallest request split
across threads; default 16).
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

__all__ = ["copy", "gather", "scatter", "coalesce", "process_vm", "ENGINE", "ENGINE_REASON"]

_native = None
if os.environ.get("KVT_NATIVE", "1") == "0":
    ENGINE_REASON = "KVT_NATIVE=0 forces the pure-Python fallback"
else:
    try:
        from . import _copy as _native
        ENGINE_REASON = "C extension kvt._copy, GIL released"
    except ImportError as e:  # e.g. an install that skipped building extensions
        ENGINE_REASON = f"kvt._copy did not load ({e}); reinstall kvt with gcc and the Python headers present"
#: ``"native"`` or ``"python"``: which engine ``copy`` uses
ENGINE = "native" if _native is not None else "python"

THREADS = max(1, int(os.environ.get("KVT_COPY_THREADS", min(4, os.cpu_count() or 1))))
SPLIT_BYTES = int(float(os.environ.get("KVT_COPY_SPLIT_MIB", 16)) * (1 << 20))

_IOV_MAX = 1024
_BIG = 16 * 1024  # fallback: rows at least this long go to memmove (user-space memcpy beats the kernel copy)
_FEW = 16  # fallback: this few short rows cost less as memmove calls than as one batched system call

_libc = ctypes.CDLL(None, use_errno=True)
_vm = {}
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name, None)
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        _vm[_name] = _fn
_self_cma = bool(_vm)  # fallback: turned off on first failure (e.g. seccomp forbids it)


def copy(dst: np.ndarray, src: np.ndarray, lengths) -> None:
    """Copy ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]`` (uint64 address
    arrays; ``lengths`` an array or one int for uniform blocks)."""
    if _native is not None:
        try:  # the common case: uint64 arrays already (columns of descriptor rows)
            _native.copy(dst, src, lengths, THREADS, SPLIT_BYTES)
        except TypeError:
            _native.copy(_u64(dst), _u64(src), int(lengths) if np.ndim(lengths) == 0 else _u64(lengths),
                         THREADS, SPLIT_BYTES)
    else:
        _copy_python(dst, src, lengths)


def _u64(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == np.uint64 and a.ndim == 1 else np.ascontiguousarray(a, np.uint64).reshape(-1)


def _copy_python(dst, src, lengths) -> None:
    global _self_cma
    dst, src = np.asarray(dst, np.uint64), np.asarray(src, np.uint64)
    lengths = np.broadcast_to(np.asarray(lengths, np.uint64), dst.shape)
    dst, src, lengths = coalesce(dst, src, lengths)
    big = lengths >= _BIG
    for d, s, n in zip(dst[big].tolist(), src[big].tolist(), lengths[big].tolist()):
        ctypes.memmove(d, s, n)
    small = ~big
    if not small.any():
        return
    d, s, n = dst[small], src[small], lengths[small]
    if _self_cma and len(n) > _FEW:
        try:
            process_vm(False, os.getpid(), _iov(d, n), _iov(s, n))
            return
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOSYS):
                raise
            _self_cma = False
    for dd, ss, nn in zip(d.tolist(), s.tolist(), n.tolist()):
        ctypes.memmove(dd, ss, nn)


def _iov(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.column_stack([addrs, lengths]), dtype=np.uint64)


def process_vm(write: bool, pid: int, local: np.ndarray, remote: np.ndarray) -> None:
    """Copy between our ``local`` ``(n, 2)`` (address, length) rows and
    ``remote`` rows of process ``pid`` (pairwise equal lengths) with Linux
    cross-memory attach; ``write`` sends local -> remote.  Raises ``OSError``
    (ESRCH: the process is gone; EPERM: not allowed; EFAULT: address not
    mapped there; ENOSYS: no such call) or ``BufferError`` on a short copy."""
    fn = _vm.get("process_vm_writev" if write else "process_vm_readv")
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv/writev not available")
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


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offs = np.zeros(len(lengths), np.uint64)
    np.cumsum(lengths[:-1], out=offs[1:])
    return offs


def gather(rows: np.ndarray) -> np.ndarray:
    """Copy the ``(addr, len)`` rows into one new contiguous buffer."""
    lengths = rows[:, 1]
    out = np.empty(int(lengths.sum()), np.uint8)
    copy(np.uint64(out.ctypes.data) + _offsets(lengths), rows[:, 0], lengths)
    return out


def scatter(rows: np.ndarray, buf) -> None:
    """Copy a contiguous buffer out into the ``(addr, len)`` rows."""
    view = np.frombuffer(buf, np.uint8)
    lengths = rows[:, 1]
    if view.nbytes != int(lengths.sum()):
        raise BufferError(f"payload of {view.nbytes} bytes for rows totalling {int(lengths.sum())}")
    copy(rows[:, 0], np.uint64(view.ctypes.data) + _offsets(lengths), lengths)
