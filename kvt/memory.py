"""Host memory that other processes on this host can map.

``empty(...)`` allocates in a memfd-backed shared segment instead of the
private heap.  Registering such memory lets a same-host peer map it once and
copy with plain ``memcpy`` (the host backend's fastest path) instead of a
kernel copy.  Segments are found by address, so any view into one qualifies.
A segment lives as long as any array or tensor viewing it; its file
descriptor closes with it, so nothing leaks when a process dies.

Segments use huge pages when the system allows (``page_policy()`` says which
and why): 4 KiB pages cost a TLB miss every 4 KiB, and a 256 MiB copy from
4 KiB-page memory runs well below one between huge-page buffers.  In order:

* ``hugetlb`` — ``memfd_create(MFD_HUGETLB)`` when enough huge pages are
  reserved (``HugePages_Free`` in /proc/meminfo); the size is rounded up to
  whole huge pages.
* ``thp`` — an ordinary memfd with ``madvise(MADV_HUGEPAGE)`` when
  /sys/kernel/mm/transparent_hugepage/shmem_enabled permits it (``always``,
  ``within_size``, ``advise`` or ``force``); sizes round up to 2 MiB.
* ``4k`` — otherwise, or when the above fail (e.g. the pool ran dry).

``KVT_HUGEPAGES=0`` forces 4 KiB pages.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import operator
import os
import threading
import weakref
from typing import Any

import numpy as np

from .errors import InvalidArgument
from .types import Descs, _shown

__all__ = ["empty", "empty_tensor", "segments_of", "page_policy", "page_kind"]

MEMINFO = "/proc/meminfo"
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_THP_SIZE = 2 << 20
_THP_ON = ("always", "within_size", "advise", "force")  # shmem_enabled values that honour MADV_HUGEPAGE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page in without touching it from Python

_lock = threading.Lock()
_segments: dict[int, tuple[int, int]] = {}  # base address -> (fd, size)
_kinds: dict[int, str] = {}  # base address -> page kind it got


def _meminfo() -> dict[str, int]:
    try:
        with open(MEMINFO) as f:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError, IndexError):  # IndexError: a line with no value
        return {}


def _huge_page_size(info: dict[str, int]) -> int:
    """Bytes per huge page (2 MiB when /proc/meminfo does not say, or says nonsense such as 0)."""
    kib = info.get("Hugepagesize", 2048)
    return (kib if 0 < kib <= 1 << 30 else 2048) << 10


def _shmem_thp() -> str:
    try:
        with open(SHMEM_THP) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text.strip()


def page_policy(nbytes: int = 1 << 30) -> tuple[str, str]:
    """``(kind, reason)``: the pages a new segment of ``nbytes`` gets,
    ``kind`` one of ``hugetlb``, ``thp``, ``4k``."""
    try:
        nbytes = max(operator.index(nbytes), 1)
    except TypeError:
        raise InvalidArgument(f"nbytes must be an int, got {type(nbytes).__name__}") from None
    if os.environ.get("KVT_HUGEPAGES", "1") == "0":
        return "4k", "KVT_HUGEPAGES=0"
    info = _meminfo()
    huge = _huge_page_size(info)
    free = info.get("HugePages_Free", 0) * huge
    hugetlb = (f"hugetlb: {info.get('HugePages_Free', 0)} of {info.get('HugePages_Total', 0)} "
               f"{huge >> 10} KiB pages free")
    if hasattr(os, "MFD_HUGETLB") and free >= -(-nbytes // huge) * huge:
        return "hugetlb", hugetlb
    thp = _shmem_thp()
    if thp in _THP_ON:
        return "thp", f"{SHMEM_THP} is {thp!r}; {hugetlb}"
    return "4k", (f"{SHMEM_THP} is {thp!r} (needs 'advise' or 'always') and {hugetlb} (reserve some with "
                  "vm.nr_hugepages) — shared segments get 4 KiB pages")


def page_kind(arr: Any) -> str | None:
    """The page kind of the segment holding ``arr``'s first byte, or None if
    it is not in a kvt segment."""
    if isinstance(arr, np.ndarray):
        addr = arr.ctypes.data
    elif hasattr(arr, "data_ptr"):
        addr = int(arr.data_ptr())
    else:
        raise InvalidArgument(f"page_kind takes a numpy array or a torch tensor, got {type(arr).__name__}")
    with _lock:
        for base, (_, size) in _segments.items():
            if base <= addr < base + size:
                return _kinds[base]
    return None


def _map(size: int, kind: str) -> tuple[int, mmap.mmap, int]:
    """(fd, mapping, mapped size) of a new pre-faulted segment with ``kind`` pages."""
    flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB if kind == "hugetlb" else 0)
    if kind != "4k":
        step = _huge_page_size(_meminfo()) if kind == "hugetlb" else _THP_SIZE
        size = -(-size // step) * step
    try:
        fd = os.memfd_create("kvt", flags | os.MFD_ALLOW_SEALING)
    except OSError:  # hugetlb memfds take seals from Linux 4.16 on
        fd = os.memfd_create("kvt", flags)
    try:
        os.ftruncate(fd, size)
        # a segment never changes size: sealed, a same-host peer that mapped it can rely on that
        # (a shrunk file would make its copies die of SIGBUS; see kvt.epoch for the same check)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError:  # a kernel without seals on this kind of memfd: unsealed, as before
            pass
        if kind == "thp":  # advise before the first fault, then fault everything in
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            mm.madvise(mmap.MADV_HUGEPAGE)
            try:
                mm.madvise(_MADV_POPULATE_WRITE)
            except OSError:  # older kernel: touch one byte per page
                np.frombuffer(mm, np.uint8)[::4096] = 0
        else:  # MAP_POPULATE pre-faults the pages so the first transfer is not a page-fault storm
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:
        os.close(fd)
        raise
    return fd, mm, size


def _forget(addr: int, fd: int) -> None:
    with _lock:
        _segments.pop(addr, None)
        _kinds.pop(addr, None)
    os.close(fd)


def empty(shape: Any, dtype: Any = np.uint8) -> np.ndarray:
    """A zero-filled, pre-faulted numpy array in a new shared segment."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument(f"dtype {dtype!r} is not a numpy dtype; pass one such as np.uint8 or 'float16'") from None
    if dtype.hasobject:
        raise InvalidArgument(f"dtype {dtype} holds Python objects, which cannot live in shared memory; "
                              "pass a numeric dtype")
    if not dtype.itemsize:  # 'V0', 'S0': no bytes to lay out, and numpy cannot view memory as them
        raise InvalidArgument(f"dtype {dtype} has items of 0 bytes; pass a dtype with a size, such as np.uint8")
    shape = _dims(shape)  # plain ints: numpy's reshape refuses bools (True) with a TypeError
    nbytes = _nbytes(shape, dtype.itemsize)
    ram = _physical_memory()
    if ram is not None and nbytes > ram:  # the segment is pre-faulted: more than RAM gets us OOM-killed
        raise InvalidArgument(f"shape {shape} of {dtype} is {nbytes} bytes, more than this machine's "
                              f"{ram} bytes of physical memory; allocate less")
    kind, _ = page_policy(max(nbytes, 1))
    kinds = [kind] + (["thp"] if kind == "hugetlb" and _shmem_thp() in _THP_ON else []) + (["4k"] if kind != "4k" else [])
    for kind in kinds:
        try:
            fd, mm, size = _map(max(nbytes, 1), kind)
            break
        except OSError:  # huge pages ran out or are refused: the next kind down
            if kind == "4k":
                raise
    flat = np.frombuffer(mm, np.uint8)
    addr = flat.ctypes.data
    with _lock:
        _segments[addr] = (fd, size)
        _kinds[addr] = kind
    weakref.finalize(mm, _forget, addr, fd)
    return flat[:nbytes].view(dtype).reshape(shape)


def _physical_memory() -> int | None:
    """Bytes of physical memory, or None when the system does not say."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return ram if ram > 0 else None  # sysconf answers -1 for "unknown"


_MAX_BYTES = 1 << 62  # no machine maps more; beyond it numpy's int64 sizes would wrap


def _dims(shape: Any) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints, not bools) as a tuple of ints."""
    try:
        try:
            dims = (operator.index(shape),)
        except TypeError:
            dims = tuple(shape)
        if any(isinstance(d, (bool, np.bool_)) for d in (shape, *dims)):
            raise TypeError
        return tuple(operator.index(d) for d in dims)
    except TypeError:
        raise InvalidArgument(f"shape {_shown(shape)} must be an int or a sequence of ints") from None


def _nbytes(shape: Any, itemsize: int) -> int:
    """The bytes of ``shape`` (ints), computed exactly: ``np.prod`` in int64 wraps silently."""
    dims = _dims(shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"negative size for shape {shape}")
    nbytes = math.prod(dims) * itemsize
    if nbytes > _MAX_BYTES:
        raise InvalidArgument(f"shape {shape} of {itemsize}-byte items is {nbytes} bytes, more than any segment")
    return nbytes


def empty_tensor(shape: Any, dtype: Any = None):
    """Like :func:`empty` but returns a CPU torch tensor (``torch`` dtype)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"dtype must be a torch dtype such as torch.float16, got {_shown(dtype)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = _dims(shape)
    raw = empty((_nbytes(shape, itemsize),), np.uint8)
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
