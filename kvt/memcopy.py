"""Batched memory copies by address: the data path of same-host transfers.

``copy(dst, src, lengths)`` copies ``lengths[i]`` bytes from address
``src[i]`` to ``dst[i]``.  The native engine (``kvt._copy``, C, built by pip
from source) runs the whole batch with the GIL released, merges runs
contiguous on both sides, and splits large requests across threads.  The
pure-Python fallback (``KVT_NATIVE=0`` forces it; also used when the
extension did not build) does one ``memmove`` per long run and hands many
short rows to the kernel in batches (``process_vm_readv`` on our own pid).

``copy_indexed`` is a whole same-host request in one call: rows picked by
index from address tables prepared once, every index and length checked
before a byte moves, and the owner's guards (registration epoch, pidfd)
read around the copy.

Callers vouch that every address is mapped and writable where needed: a
wrong address crashes the process, as a wrong pointer does in C.

Tuning (environment): ``KVT_COPY_THREADS`` (threads for one large request;
default ``min(4, cpus)``), ``KVT_COPY_SPLIT_MIB`` (smallest request split
across threads; default 1; under ``WAKE_WORTH``, 16 MiB, only requests that
come back to back, within 4 spins of the previous one), ``KVT_COPY_SPIN_US``
(how long a helper thread watches for the next of back-to-back split
requests before parking; default 100, 0 parks at once and splits only from
``WAKE_WORTH``: waking a parked thread costs about as much as copying 1 MiB
on a VM, so isolated requests are copied by the posting thread alone and
never spin), ``KVT_COPY_STREAM_MIB`` (requests of at least this size in
total are written with non-temporal stores, which skip reading each
destination line before writing it: a KV load's blocks come from memory,
not cache; default 16, 0 never; x86-64).  A copy that runs in the
background, on a backend's worker while the thread that posted it goes on
(polling, or computing), gets ``BACKGROUND_THREADS``: one CPU fewer, so it
does not fight that thread for the machine (on 2 CPUs: 0.95-0.99x memcpy
with one thread against 0.85-0.91x with two, next to a polling caller).
The helpers may run on every CPU the posting thread may except the one it
is on (re-aimed when that changes): on a VM the scheduler sees an idle vCPU
the host took away as busy and wakes a helper onto the poster's own CPU,
where the two take turns and a split copy runs at one thread's speed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import math
import os
import platform
import select

import numpy as np

from . import extensions

__all__ = ["copy", "copy_indexed", "gather", "scatter", "coalesce", "process_vm", "ENGINE", "ENGINE_REASON",
           "STALE", "TOO_BIG", "DEAD", "STALE_AFTER", "atomic_add", "atomic_cas", "keep_alive", "stop_alive"]

_native, ENGINE_REASON = extensions.load("kvt._copy", "kvt", "pure-Python fallback")
if _native is not None:
    ENGINE_REASON += ", GIL released"
#: ``"native"`` or ``"python"``: which engine ``copy`` uses
ENGINE = "native" if _native is not None else "python"

_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
MAX_THREADS = 16  # the native engine's cap (MAX_THREADS in _copy.c)


def _env_number(name: str, default: float, lo: float, hi: float) -> float:
    """``name`` from the environment as a number clamped to ``[lo, hi]``; the
    default, with a warning, when it is not a finite number (NaN, inf, text):
    a tuning knob must not make ``import kvt`` or every copy fail."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        logging.getLogger(__name__).warning("ignoring %s=%r (not a finite number); using %s", name, raw, default)
        return default
    return min(max(value, lo), hi)


THREADS = int(_env_number("KVT_COPY_THREADS", min(4, _CPUS), 1, MAX_THREADS))
#: threads for a copy on a worker thread, beside the still-running thread that posted it
BACKGROUND_THREADS = max(1, min(THREADS, _CPUS - 1))
SPLIT_BYTES = int(_env_number("KVT_COPY_SPLIT_MIB", 1, 0, 1 << 40) * (1 << 20))
#: the native engine splits a request under this size only when it comes back to back with the
#: previous one (its helpers are then awake); from this size on, waking one is worth it (_copy.c)
WAKE_WORTH = 16 << 20
SPIN_US = _env_number("KVT_COPY_SPIN_US", 100, 0, 10_000)
#: the native engine writes requests of at least this many bytes with non-temporal stores (x86-64)
STREAM_BYTES = int(_env_number("KVT_COPY_STREAM_MIB", 16, 0, 1 << 40) * (1 << 20))
#: whether and from what size copies stream, for ``kvt backends``
STREAMING = ("only with the native engine" if _native is None
             else f"not on {platform.machine()} (x86-64 only)" if platform.machine() not in ("x86_64", "AMD64")
             else "off (KVT_COPY_STREAM_MIB=0)" if not STREAM_BYTES
             else f"requests of {STREAM_BYTES / (1 << 20):g} MiB and more (KVT_COPY_STREAM_MIB)")
if _native is not None:
    _native.set_spin(int(SPIN_US * 1000))
    _native.set_stream(STREAM_BYTES)
    _native.set_split(SPLIT_BYTES, THREADS)

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


#: ``atomic_add(address, delta) -> new`` and ``atomic_cas(address, expected, new) -> bool`` on a
#: uint64 in shared memory, each with a full fence (``kvt.epoch``'s guard slots); ``None`` with the
#: pure-Python engine, which has no atomics: its callers take locks instead
atomic_add = None if _native is None else _native.atomic_add
atomic_cas = None if _native is None else _native.atomic_cas
#: ``keep_alive(fd, offset) -> (tid, keeper)``: a thread of ours holds the uint32 at ``offset`` of
#: the shared file ``fd`` at its id until ``stop_alive(keeper)``; if this process dies first, the
#: kernel clears the id (the owner's liveness word in ``kvt.epoch``).  ``None`` with the
#: pure-Python engine.
keep_alive = None if _native is None else _native.keep_alive
stop_alive = None if _native is None else _native.stop_alive

#: what ``copy_indexed`` returns instead of a byte count: nothing copied because the
#: epoch word moved (STALE) or the request exceeds ``max_bytes`` (TOO_BIG); copied,
#: but the pidfd shows the process exited (DEAD) or the epoch moved meanwhile (STALE_AFTER)
STALE, TOO_BIG, DEAD, STALE_AFTER = -1, -2, -3, -4
_FUTEX_TID_MASK = 0x3FFFFFFF  # <linux/futex.h>: a liveness word's thread id bits
_NO_LIMIT = (1 << 64) - 1


def copy_indexed(dst: np.ndarray, di: np.ndarray, src: np.ndarray, si: np.ndarray, lengths, src_lengths=None,
                 max_bytes: int = _NO_LIMIT, epoch: int = 0, seen: int = 0, pidfd: int = -1,
                 threads: int = THREADS, lock: int = -1, slot: int = 0, alive: int = 0, tid: int = 0) -> int:
    """For every ``k``, copy row ``di[k]`` of the table ``(dst, lengths)``
    from row ``si[k]`` of ``(src, src_lengths)``.

    ``dst``/``src``: 1-D uint64 address tables; ``di``/``si``: 1-D int64
    indices; ``lengths``: a uint64 table or one int (uniform rows);
    ``src_lengths``: the source table's lengths, to check pairs against
    (``None``: the caller knows they match).  Raises ``IndexError`` (an
    index outside its table) or ``ValueError`` (unequal counts or pair
    lengths) before any byte moves.  Returns the bytes copied, or one of
    ``STALE``, ``TOO_BIG`` (nothing copied), ``DEAD``, ``STALE_AFTER``
    (copied, but the data must not count): ``epoch`` is the address of an
    8-byte word that must equal ``seen`` before and after the copy (0: no
    check), ``pidfd`` a pidfd that must not be readable after it (-1: none),
    ``lock`` a file to hold a shared ``flock`` on from before the first check
    to after the last (-1: none; ``STALE`` when it cannot be had at once: its
    owner holds it exclusively while it drains the copies under way).
    ``slot``, instead of ``lock``: the address of the caller's guard slot on
    the owner's epoch page (``kvt.epoch``), counted up before the first check
    and down after the last; native engine only (``atomic_add`` is ``None``
    without it, and no slot is handed out).  ``alive``, instead of ``pidfd``:
    the address of the owner's liveness word, which must still hold ``tid``
    after the copy (else ``DEAD``; see ``keep_alive``).
    ``threads``: at most this many for a large request (``BACKGROUND_THREADS``
    off the posting thread).  With the native engine built, this name is
    ``kvt._copy.copy_indexed`` itself: the same call in C.
    """
    if slot:
        raise ValueError("guard slots need the native engine (kvt._copy); pass lock instead")
    return _copy_indexed_python(dst, di, src, si, lengths, src_lengths, max_bytes, epoch, seen, pidfd, lock,
                                alive, tid)


_py_copy_indexed = copy_indexed  # the pure-Python engine's (the name's value under KVT_NATIVE=0)
if _native is not None:  # the same call in C, taken straight: no Python frame on every request's path
    copy_indexed = _native.copy_indexed  # noqa: F811


def _copy_indexed_python(dst, di, src, si, lengths, src_lengths, max_bytes, epoch, seen, pidfd, lock, alive=0,
                         tid=0) -> int:
    di, si = _index(di, "di"), _index(si, "si")
    if di.size != si.size:
        raise ValueError(f"di selects {di.size} rows but si {si.size}; they are paired one to one")
    dst, src = _u64(dst), _u64(src)
    # a negative int64 index viewed as uint64 is past any table
    if di.size and (int(di.view(np.uint64).max()) >= len(dst) or int(si.view(np.uint64).max()) >= len(src)):
        raise IndexError(f"an index lies outside tables of {len(dst)} and {len(src)} rows")
    if np.ndim(lengths) == 0:
        n = np.full(di.size, int(lengths), np.uint64)
    else:
        n = _u64(lengths)
        if len(n) != len(dst):
            raise ValueError(f"lengths has {len(n)} rows, dst {len(dst)}")
        n = n[di]
    if src_lengths is not None:
        sl = _u64(src_lengths)
        if len(sl) != len(src):
            raise ValueError(f"src_lengths has {len(sl)} rows, src {len(src)}")
        if (sl[si] != n).any():
            raise ValueError("paired rows differ in length")
    total = _sum(n)
    if total >= 1 << 64:
        raise OverflowError("lengths sum past 2**64")
    _check_wrap(dst[di], src[si], n)
    if total > max_bytes:
        return TOO_BIG
    if total >= 1 << 63:  # the count would read as a negative outcome (STALE...)
        raise OverflowError("lengths sum past 2**63")
    if lock >= 0:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # not only EWOULDBLOCK: whatever the reason, nothing is copied
            return STALE
    try:
        if epoch and _word(epoch) != seen:
            return STALE
        _copy_python(dst[di], src[si], n)
        if (ctypes.c_uint32.from_address(alive).value & _FUTEX_TID_MASK != tid) if alive else \
                (pidfd >= 0 and _exited(pidfd)):
            return DEAD
        if epoch and _word(epoch) != seen:
            return STALE_AFTER
        return total
    finally:
        if lock >= 0:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _index(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or a.dtype != np.int64:
        raise TypeError(f"{what} must be a 1-D array of native int64 (got ndim {a.ndim}, dtype {a.dtype})")
    return a


def _word(addr: int) -> int:
    return ctypes.c_uint64.from_address(addr).value


def _exited(pidfd: int) -> bool:
    """A pidfd turns readable when its process exits; an error counts as gone."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    try:
        return bool(p.poll(0))
    except OSError:
        return True


def _u64(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == np.uint64 and a.ndim == 1 else np.ascontiguousarray(a, np.uint64).reshape(-1)


def _sum(lengths: np.ndarray) -> int:
    """The exact sum of uint64 ``lengths`` (numpy's own wraps past 2**64)."""
    if not lengths.size:
        return 0
    if int(lengths.max()) * lengths.size < 1 << 64:  # the common case: it cannot wrap
        return int(lengths.sum(dtype=np.uint64))
    return sum(lengths.tolist())


def _check_wrap(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """ValueError for a row whose address + length wraps past 2**64 (as the native engine)."""
    with np.errstate(over="ignore"):
        bad = (dst + lengths < dst) | (src + lengths < src)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"row {i}: address + length wraps past 2**64 (dst {int(dst[i])}, src {int(src[i])}, "
                         f"{int(lengths[i])} bytes)")


def _copy_python(dst, src, lengths) -> None:
    global _self_cma
    dst, src = np.asarray(dst, np.uint64), np.asarray(src, np.uint64)
    if dst.shape != src.shape:
        raise ValueError(f"src has {src.size} rows, dst {dst.size}")
    lengths = np.broadcast_to(np.asarray(lengths, np.uint64), dst.shape)
    if _sum(lengths) >= 1 << 64:
        raise OverflowError("lengths sum past 2**64")
    _check_wrap(dst, src, lengths)
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


def gather(rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Copy the ``(addr, len)`` rows into one contiguous buffer: a new one,
    or the start of ``out`` (uint8, large enough); returns the bytes filled."""
    lengths = rows[:, 1]
    n = int(lengths.sum())
    if out is None:
        out = np.empty(n, np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or out.nbytes < n:
        raise BufferError(f"gather: out must be contiguous uint8 of at least {n} bytes")
    else:
        out = out[:n]
    copy(np.uint64(out.ctypes.data) + _offsets(lengths), rows[:, 0], lengths)
    return out


def scatter(rows: np.ndarray, buf) -> None:
    """Copy a contiguous buffer out into the ``(addr, len)`` rows."""
    view = np.frombuffer(buf, np.uint8)
    lengths = rows[:, 1]
    if view.nbytes != int(lengths.sum()):
        raise BufferError(f"payload of {view.nbytes} bytes for rows totalling {int(lengths.sum())}")
    copy(rows[:, 0], np.uint64(view.ctypes.data) + _offsets(lengths), lengths)
