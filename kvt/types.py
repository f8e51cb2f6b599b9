"""Value types of the protocol: memory kinds, operations, transfer states,
capabilities and descriptor lists.

A descriptor list is one ``(n, 3)`` uint64 numpy array of rows
``(address, length, device)``; every operation on it is vectorised, since
engines move 100,000 blocks at a time.
"""

from __future__ import annotations

import bisect
import enum
import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, NewType, Sequence

import msgspec
import numpy as np

from .errors import InvalidArgument, InvalidDescriptor, TransferError

__all__ = [
    "MemKind", "Op", "Status", "XferState", "Capabilities", "Availability",
    "Descs", "RegHandle", "PrepHandle", "XferHandle", "SETTLED", "is_settled", "as_index", "row_ends",
]

RegHandle = NewType("RegHandle", int)
PrepHandle = NewType("PrepHandle", int)
XferHandle = NewType("XferHandle", int)
#: What ``Backend.transfer`` returns for a request that completed before it
#: returned, every byte in place (as UCX's ``NULL`` request and NIXL's
#: ``NIXL_SUCCESS`` from a post): not a handle to anything, so there is nothing
#: to poll or free; ``check_state(SETTLED)`` is ``DONE`` and
#: ``release(SETTLED)`` does nothing, any number of times.  Handles of
#: transfers are never 0.
SETTLED = XferHandle(0)


def is_settled(handle: Any) -> bool:
    """``handle`` is ``SETTLED``: the int 0 itself (not a bool, numpy int or other int subclass)."""
    return type(handle) is int and handle == SETTLED


class MemKind(str, enum.Enum):
    """Where memory lives."""

    DRAM = "DRAM"      #: host memory
    VRAM = "VRAM"      #: CUDA device memory
    DEVICE = "DEVICE"  #: memory of any other torch device (XPU, MPS, NPU, ...)

    @classmethod
    def of_device(cls, device: Any) -> "MemKind":
        """The kind for a torch device (or its type string)."""
        kind = getattr(device, "type", device)
        return cls.DRAM if kind == "cpu" else cls.VRAM if kind == "cuda" else cls.DEVICE


class Op(str, enum.Enum):
    """A one-sided operation, seen from the initiator."""

    READ = "READ"    #: remote -> local
    WRITE = "WRITE"  #: local -> remote


class Status(str, enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


# module constants: polling is a hot path, and enum attribute lookups are not free
_PROC, _DONE, _ERR = Status.PROC, Status.DONE, Status.ERR


@dataclass(frozen=True, slots=True)
class XferState:
    """What ``check_state`` returns: a status and, for ``ERR``, its cause.

    ``XferState.PROC`` and ``XferState.DONE`` are singletons;
    ``XferState.err(cause)`` builds an error state.  ``done``, ``failed``
    and ``pending`` say which status it is.
    """

    status: Status
    cause: TransferError | None = None
    # plain fields, not properties: every poll reads one, and a property costs ~0.1 us more
    done: bool = field(init=False, repr=False, compare=False)
    failed: bool = field(init=False, repr=False, compare=False)
    pending: bool = field(init=False, repr=False, compare=False)

    PROC: ClassVar["XferState"]
    DONE: ClassVar["XferState"]

    def __post_init__(self) -> None:
        for name, status in (("done", _DONE), ("failed", _ERR), ("pending", _PROC)):
            object.__setattr__(self, name, self.status is status)

    @classmethod
    def err(cls, cause: TransferError) -> "XferState":
        return cls(Status.ERR, cause)

    def __repr__(self) -> str:
        return f"XferState.{self.status.value}" + (f"({self.cause!r})" if self.cause else "")


XferState.PROC = XferState(Status.PROC)
XferState.DONE = XferState(Status.DONE)


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can do, declared as data on its class.

    Opt-in: ``Capabilities()`` declares nothing (no memory, no operation, no
    peers), so a field a plugin forgets under-declares, never over-declares.
    State every field.  An operation outside these raises
    ``UnsupportedOperation``; the conformance suite skips tests whose
    capability is not declared and fails a backend that does not keep what
    it declares.
    """

    mem_kinds: frozenset[MemKind] = frozenset()
    ops: frozenset[Op] = frozenset()
    notifications: bool = False
    #: transfers between two descriptor lists of the same agent (``prep(None, ...)``)
    local: bool = False
    #: transfers to another process
    remote: bool = False
    #: peers on other hosts: nothing may rely on shared memory, pids or loopback
    cross_host: bool = False
    #: largest message ``notify`` accepts
    max_notif_bytes: int = 0
    #: options that turn off every same-host shortcut (shared memory, process_vm_readv,
    #: UCX's shm transports...), so two agents on one host talk as across hosts; the
    #: conformance suite runs its cross_host tests with them
    cross_host_options: dict[str, Any] = {}
    #: once a transfer has ended (``ERR`` included) none of its bytes land any more, even
    #: from a peer that stopped answering and runs again: an engine may reuse the memory of
    #: a failed READ at once (it does: vLLM gives the blocks of a failed load to the next request)
    stops_on_err: bool = False
    #: how the owner of memory refuses requests for memory it has not registered now:
    #: ``"server"`` (a target-side server checks each request and answers ``RemoteRejected``)
    #: or ``"transport"`` (one-sided: the transport's remote keys exist only for registered
    #: memory and die with the registration); ``""`` declares nothing
    owner_check: str = ""


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether a backend can run on this machine and, if not, why."""

    usable: bool
    reason: str = ""


def as_index(idx: Any, n: int, what: str = "index") -> np.ndarray:
    """Normalise ``idx`` (None = all, int sequence, array) to int64 and bounds-check it."""
    if idx is None:
        return np.arange(n, dtype=np.int64)
    if type(idx) is np.ndarray:
        arr = idx
    else:
        try:
            arr = np.asarray(idx)
        except (TypeError, ValueError, OverflowError):  # e.g. ragged [[1], [1, 2]]
            raise InvalidArgument(f"{what} must be a 1-D sequence of ints, got {_shown(idx)}") from None
    given = arr  # for the message: uint64 ids past 2**63 show negative once cast
    if arr.dtype != _INT64 or arr.ndim != 1:
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            if arr.ndim == 1 and arr.dtype.kind in "fO" and type(idx) is not np.ndarray \
                    and all(type(x) is int for x in idx):  # (error path) ints past int64: numpy made floats
                lo, hi = (v if v.bit_length() <= 128 else f"<int of {v.bit_length()} bits>"
                          for v in (min(idx), max(idx)))
                raise InvalidArgument(f"{what} out of range: values must lie in [0, {n}), got [{lo}, {hi}]")
            raise InvalidArgument(f"{what} must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.size:
        u = arr.view(np.uint64)  # a negative index viewed as uint64 is past any n: one comparison
        # a few ids: Python's max costs less than a numpy reduction's fixed overhead
        try:
            past = (max(u.tolist()) if arr.size <= 16 else u.max()) >= n
        except TypeError:
            raise InvalidArgument(f"{what}: the count to check against must be an int, got {_shown(n)}") from None
        if past:
            raise InvalidArgument(f"{what} out of range: values must lie in [0, {n}), "
                                  f"got [{given.min()}, {given.max()}]")
    return arr


_INT64 = np.dtype(np.int64)
_U64_LIMIT = 1 << 64
#: up to this many rows, ``check_rows`` and ``locate`` run on Python ints (numpy's fixed cost per call,
#: tens of microseconds once a large copy has flushed the caches, dominates a few rows)
_FEW_ROWS = 16


def _shown(value: Any) -> str:
    """``value``'s repr for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _as_u64(value: Any, what: str) -> np.ndarray:
    """``value`` as a uint64 array; ``InvalidArgument`` naming ``what`` for a
    negative, too large or non-integer value.  Casting straight to uint64
    would truncate floats and wrap negative int64 arrays silently."""
    if type(value) is np.ndarray and value.dtype == np.uint64:
        return value
    if type(value) is int and 0 <= value < _U64_LIMIT:
        return np.asarray(value, dtype=np.uint64)
    try:
        arr = np.asarray(value)
        if arr.dtype.kind in "fO" and type(value) is not np.ndarray:
            # Python ints past int64 come out as objects, or floats when mixed with small ones:
            # exact ints only (a rare, slow path), then numpy range-checks each on the way to uint64
            items = np.asarray(value, dtype=object).ravel()
            if all(type(x) is int or isinstance(x, np.integer) for x in items):
                return np.asarray(value, dtype=np.uint64)
            arr = None
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is not None and (arr.dtype.kind == "u" or (arr.dtype.kind == "i" and not (arr.size and arr.min() < 0))
                            or arr.size == 0):  # [] is float64 to numpy
        return arr.astype(np.uint64, copy=False)
    raise InvalidArgument(f"{what} must be integers in [0, 2**64), got {_shown(value)}")


def _u64_scalar(value: Any, what: str) -> int:
    """``value`` as an int in [0, 2**64), or ``InvalidArgument`` naming ``what``."""
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an int in [0, 2**64), got {type(value).__name__} "
                              f"{_shown(value)}") from None
    if not 0 <= n < _U64_LIMIT:
        raise InvalidArgument(f"{what} must be an int in [0, 2**64), got {n}")
    return n


def row_ends(addrs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``addr + length`` of each row and a mask of the rows whose end does not
    wrap past 2**64.  The one place kvt adds an address to a length: uint64
    addition wraps silently, so every range check must drop the rows this
    mask clears (``(2**64 - 4096, 4096)`` would otherwise end at 0)."""
    a, n = np.asarray(addrs, np.uint64), np.asarray(lengths, np.uint64)
    ends = a + n
    return ends, ends >= a


def _contained(addrs: np.ndarray, lengths: np.ndarray, starts: np.ndarray, best_end: np.ndarray,
               holder: np.ndarray) -> np.ndarray:
    """For rows on one device, the region row holding each (``holder`` of the
    last region starting at or before it, if the ends reach), else -1."""
    pos = np.searchsorted(starts, addrs, side="right") - 1
    posc = np.maximum(pos, 0)
    end, fits = row_ends(addrs, lengths)
    return np.where((pos >= 0) & fits & (end <= best_end[posc]), holder[posc], -1)


def _contained_one(addr: int, length: int, found: tuple | None) -> int:
    """``_contained`` of one row, on Python ints."""
    if found is None:
        return -1
    starts, best_end, holder = found[3:]
    pos = bisect.bisect_right(starts, addr) - 1
    # (exact ints: a row past 2**64 ends past every region's end, which is below it)
    return holder[pos] if pos >= 0 and addr + length <= best_end[pos] else -1


class Descs:
    """An immutable list of memory descriptors ``(address, length, device)``.

    ``array`` is an ``(n, 3)`` uint64 array; ``kind`` the memory kind of every
    row.  ``tensors`` optionally keeps the torch tensors or numpy arrays the
    rows were taken from alive (and lets a staging backend reach device
    memory through torch).
    """

    __slots__ = ("array", "kind", "tensors", "_uniform", "_index")

    def __init__(self, array: Any, kind: MemKind | str = MemKind.DRAM, tensors: Sequence[Any] = ()):
        try:
            arr = np.asarray(array)
        except (TypeError, ValueError, OverflowError):  # e.g. ragged rows [[1, 2, 3], [1, 2]]
            raise InvalidArgument("descriptors must have shape (n, 3) of (address, length, device) "
                                  f"integers, got {_shown(array)}") from None
        if arr.size == 0:
            arr = arr.reshape(0, 3)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise InvalidArgument(f"descriptors must have shape (n, 3) of (address, length, device), got {arr.shape}")
        if arr.dtype.kind not in "iu" and arr.size:
            raise InvalidArgument(f"descriptors must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
            raise InvalidArgument("descriptor addresses, lengths and devices must be non-negative")
        arr = np.ascontiguousarray(arr, dtype=np.uint64)
        arr.flags.writeable = False
        try:
            kind = MemKind(kind)
        except ValueError:
            raise InvalidArgument(f"unknown memory kind {kind!r}; use one of {[k.value for k in MemKind]}") from None
        self.array, self.kind, self.tensors = arr, kind, tuple(tensors)
        self._uniform: int | None | bool = False  # not computed yet
        self._index: dict[int, tuple] | None = None  # locate's, built once

    # -- construction -----------------------------------------------------

    @classmethod
    def from_regions(cls, addrs: Any, lengths: Any, devices: Any = 0,
                     kind: MemKind | str = MemKind.DRAM) -> "Descs":
        """Rows from parallel address/length(/device) sequences (broadcast)."""
        cols = [_as_u64(x, what) for x, what in ((addrs, "addrs"), (lengths, "lengths"), (devices, "devices"))]
        try:
            a, l, d = np.broadcast_arrays(*cols)
        except ValueError:
            raise InvalidArgument("addrs, lengths and devices must have the same length (or be scalars), got "
                                  f"shapes {', '.join(str(c.shape) for c in cols)}") from None
        return cls(np.stack([a.ravel(), l.ravel(), d.ravel()], axis=1), kind)

    @classmethod
    def from_blocks(cls, base_addrs: Any, block_len: int, block_ids: Any, *,
                    stride: int | None = None, device: int = 0,
                    kind: MemKind | str = MemKind.DRAM) -> "Descs":
        """Block descriptors ``base + id * stride`` for every base (e.g. one
        per layer) and every block id, base-major.  Vectorised: 100,000 blocks
        cost one numpy broadcast."""
        bases = _as_u64(base_addrs, "base_addrs").ravel()
        ids = _as_u64(block_ids, "block_ids").ravel()
        block_len = _u64_scalar(block_len, "block_len")
        step = np.uint64(block_len if stride is None else _u64_scalar(stride, "stride"))
        rows = np.empty((len(bases), len(ids), 3), np.uint64)
        np.add(bases[:, None], ids[None, :] * step, out=rows[:, :, 0])
        rows[:, :, 1] = block_len
        rows[:, :, 2] = _u64_scalar(device, "device")
        return cls(rows.reshape(-1, 3), kind)

    @classmethod
    def empty(cls, kind: MemKind | str = MemKind.DRAM) -> "Descs":
        return cls(np.zeros((0, 3), np.uint64), kind)

    @classmethod
    def from_buffers(cls, buffers: Iterable[Any], kind: MemKind | str | None = None) -> "Descs":
        """One row per torch tensor or numpy array (each must be contiguous).

        ``kind`` defaults to the tensors' device kind; passing it explicitly
        lets a test treat host memory as device memory.
        """
        try:
            buffers = list(buffers)
        except TypeError:
            raise InvalidArgument(f"buffers must be a list of torch tensors or numpy arrays, got "
                                  f"{type(buffers).__name__}") from None
        if kind is not None:
            try:
                kind = MemKind(kind)
            except ValueError:
                raise InvalidArgument(f"unknown memory kind {kind!r}; "
                                      f"use one of {[k.value for k in MemKind]}") from None
        rows, kinds = [], set()
        for buf in buffers:
            if hasattr(buf, "data_ptr"):  # torch.Tensor
                if str(getattr(buf, "layout", "torch.strided")) != "torch.strided":  # sparse, mkldnn...
                    raise InvalidArgument(f"a {buf.layout} tensor has no one block of memory to register; "
                                          "register a dense tensor (.to_dense())")
                if not buf.is_contiguous():
                    raise InvalidArgument("tensor must be contiguous to be registered; call .contiguous() first")
                dev = buf.device
                if dev.type == "meta":  # data_ptr() is 0: a backend would read and write address 0
                    raise InvalidArgument("a meta tensor has no memory to register; allocate it on a real device")
                rows.append((buf.data_ptr(), buf.numel() * buf.element_size(), dev.index or 0))
                kinds.add(MemKind.of_device(dev))
            elif isinstance(buf, np.ndarray):
                if kind is not None and kind is not MemKind.DRAM:  # backends reach device memory through torch
                    raise InvalidArgument(f"a numpy array is host memory and cannot be registered as {kind.value}; "
                                          "register it as DRAM, or pass a torch tensor to stand in for device memory")
                if not buf.flags.c_contiguous:
                    raise InvalidArgument("numpy array must be C-contiguous to be registered")
                rows.append((buf.ctypes.data, buf.nbytes, 0))
                kinds.add(MemKind.DRAM)
            else:
                raise InvalidArgument(f"cannot register {type(buf).__name__}; pass torch tensors, numpy arrays "
                                      "or (address, length, device) rows")
        if kind is None:
            if len(kinds) > 1:
                raise InvalidArgument(f"buffers mix memory kinds {sorted(k.value for k in kinds)}; register each kind separately")
            kind = kinds.pop() if kinds else MemKind.DRAM
        return cls(np.array(rows, dtype=np.uint64).reshape(-1, 3), kind, buffers)

    @classmethod
    def coerce(cls, mem: Any, kind: MemKind | str | None = None) -> "Descs":
        """Accept Descs, an (n, 3) array, a list of (addr, len, dev) tuples, or buffers."""
        if isinstance(mem, Descs):
            if kind is not None and kind != mem.kind:
                return cls(mem.array, kind, mem.tensors)  # validates kind
            return mem
        if hasattr(mem, "data_ptr") or (isinstance(mem, np.ndarray) and mem.dtype != np.uint64 and mem.ndim != 2):
            return cls.from_buffers([mem], kind)
        if isinstance(mem, np.ndarray) and mem.ndim == 2 and mem.shape[1:] == (3,):
            return cls(mem, kind or MemKind.DRAM)
        if isinstance(mem, (str, bytes, bytearray)) or not hasattr(mem, "__iter__"):
            raise InvalidArgument(f"cannot describe memory with {type(mem).__name__}: pass Descs, an (n, 3) array, "
                                  "(address, length, device) rows, or torch tensors / numpy arrays")
        seq = list(mem)
        if seq and (hasattr(seq[0], "data_ptr") or isinstance(seq[0], np.ndarray)):
            return cls.from_buffers(seq, kind)
        # checked as from_regions' columns are: a float address (4096.9) is refused, not truncated
        rows = _as_u64(seq, "descriptor rows (address, length, device)")
        try:
            rows = rows.reshape(-1, 3)
        except ValueError:
            raise InvalidArgument(f"descriptor rows must be (address, length, device) integer triples, "
                                  f"got {_shown(seq)}") from None
        return cls(rows, kind or MemKind.DRAM)

    # -- views --------------------------------------------------------------

    @property
    def addrs(self) -> np.ndarray:
        return self.array[:, 0]

    @property
    def lengths(self) -> np.ndarray:
        return self.array[:, 1]

    @property
    def devices(self) -> np.ndarray:
        return self.array[:, 2]

    @property
    def uniform_length(self) -> int | None:
        """The length every row has, or None if they differ (or there are no
        rows).  Computed once: a list is immutable, and prepped lists are
        reused by every transfer."""
        if self._uniform is False:
            n = self.lengths
            self._uniform = int(n[0]) if len(n) and bool((n == n[0]).all()) else None
        return self._uniform

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, idx: Any) -> "Descs":
        if isinstance(idx, tuple):  # d[:, 0] would be a column, not rows
            raise InvalidArgument(f"select whole descriptor rows (an int, a slice, an index or boolean array), "
                                  f"got {_shown(idx)}")
        try:
            rows = self.array[idx]
        except (IndexError, TypeError, ValueError) as e:
            raise InvalidArgument(f"cannot select descriptor rows with {_shown(idx)}: {e}") from None
        return Descs(rows.reshape(-1, 3), self.kind, self.tensors)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Descs) and self.kind is other.kind and np.array_equal(self.array, other.array)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Descs(n={len(self)}, kind={self.kind.value}, nbytes={self.nbytes})"

    # -- containment ----------------------------------------------------------

    def locate(self, regions: "Descs") -> np.ndarray:
        """For each row, the index of a row of ``regions`` that wholly contains
        it (same device), or -1.  Vectorised: regions sorted by start with the
        running maximum of their ends (built once per ``regions``, which is
        immutable: a server checks every request against the same table), then
        one binary search per descriptor."""
        if not isinstance(regions, Descs):
            raise InvalidArgument(f"regions must be Descs, got {type(regions).__name__}")
        if not len(self) or not len(regions):
            return np.full(len(self), -1, dtype=np.int64)
        index = regions._index if regions._index is not None else regions._build_index()
        if len(self) <= _FEW_ROWS:  # a few rows (a peer's small request): Python ints beat numpy's per-call cost
            return np.array([_contained_one(a, n, index.get(d)) for a, n, d in self.array.tolist()], np.int64)
        devs = self.devices
        if bool((devs == devs[0]).all()):  # the common case: one device, no per-device split
            found = index.get(int(devs[0]))
            return np.full(len(self), -1, dtype=np.int64) if found is None else \
                _contained(self.addrs, self.lengths, *found[:3])
        out = np.full(len(self), -1, dtype=np.int64)
        # only devices both sides have: a row on any other stays -1 at no cost (a peer's request of
        # 65,536 rows on as many devices was one O(n) pass per device: seconds of a server thread)
        for dev in np.intersect1d(devs, regions.devices).tolist():
            dsel = np.flatnonzero(devs == dev)
            out[dsel] = _contained(self.addrs[dsel], self.lengths[dsel], *index[dev][:3])
        return out

    def overlaps(self, rows: Any) -> bool:
        """Whether any of ``rows`` (``(k, 3)`` address, length, device, as
        another list's ``array``) shares a byte with a row of this list on the
        same device.  Vectorised, on ``locate``'s index: the last region
        starting below a row's end overlaps it if the running maximum of the
        ends reaches past the row's start.  (What ``deregister`` asks of the
        requests still under way: do they touch the memory it removes?)"""
        rows = np.asarray(rows, np.uint64).reshape(-1, 3)
        if not len(rows) or not len(self):
            return False
        index = self._index if self._index is not None else self._build_index()
        for dev in np.unique(rows[:, 2]).tolist():
            if (found := index.get(dev)) is None:
                continue
            on = rows[:, 2] == dev
            sel = rows if bool(on.all()) else rows[on]
            ends, fits = row_ends(sel[:, 0], sel[:, 1])
            ends = np.where(fits, ends, np.uint64(_U64_LIMIT - 1))  # a wrapping row reaches the top
            pos = np.searchsorted(found[0], ends, side="left") - 1
            if bool(((pos >= 0) & (found[1][np.maximum(pos, 0)] > sel[:, 0]) & (sel[:, 1] > 0)).any()):
                return True
        return False

    def _build_index(self) -> dict[int, tuple]:
        """Per device: region starts in order, the running maximum of their
        ends, and the row achieving it (what ``locate`` searches), as arrays
        and as lists."""
        index = {}
        devs = self.devices
        for dev in np.unique(devs).tolist():
            rsel = np.flatnonzero(devs == dev)
            order = rsel[np.argsort(self.addrs[rsel], kind="stable")]
            starts = self.addrs[order]
            ends, fits = row_ends(starts, self.lengths[order])
            ends = np.where(fits, ends, starts)  # a region that wraps contains nothing
            best_end = np.maximum.accumulate(ends)
            # index (into order) of the region achieving the running max end
            arg = np.maximum.accumulate(np.where(ends == best_end, np.arange(len(ends)), 0))
            holder = order[arg]
            index[dev] = (starts, best_end, holder, starts.tolist(), best_end.tolist(), holder.tolist())
        self._index = index  # (two threads may both build it: the same value)
        return index

    def check_rows(self, what: str, *, max_rows: int | None = None, max_bytes: int | None = None) -> None:
        """Refuse rows no transfer or registration can mean: zero length, an
        end past 2**64, more than ``max_rows`` rows or ``max_bytes`` in all
        (``InvalidDescriptor`` naming the first bad row).  The byte total is
        summed without wrapping.  For lists that come from a peer."""
        if max_rows is not None and len(self) > max_rows:
            raise InvalidDescriptor(f"{what}: {len(self)} rows, more than the limit of {max_rows}")
        if len(self) <= _FEW_ROWS:  # as in locate: Python ints
            rows = self.array.tolist()
            bad = [i for i, (a, n, _) in enumerate(rows) if n == 0 or a + n >= _U64_LIMIT]
            if bad:
                self._refuse_row(what, bad[0])
            if max_bytes is not None and sum(n for _, n, _ in rows) > max_bytes:
                raise InvalidDescriptor(f"{what}: more than the limit of {max_bytes} bytes in one request")
            return
        _, fits = row_ends(self.addrs, self.lengths)
        bad = np.flatnonzero(~fits | (self.lengths == 0))
        if bad.size:
            self._refuse_row(what, int(bad[0]))
        if max_bytes is not None:
            n = self.lengths  # the float sum screens out totals that would wrap the exact uint64 sum
            if (n > np.uint64(max_bytes)).any() or n.sum(dtype=np.float64) > 2.0 ** 62 \
                    or int(n.sum(dtype=np.uint64)) > max_bytes:
                raise InvalidDescriptor(f"{what}: more than the limit of {max_bytes} bytes in one request")

    def _refuse_row(self, what: str, i: int) -> None:
        a, n, _ = (int(x) for x in self.array[i])
        raise InvalidDescriptor(f"{what}: row {i} (address {a:#x}, length {n}) is empty or "
                                "ends past the top of the address space")

    def check_within(self, regions: "Descs", what: str = "descriptors") -> np.ndarray:
        """``locate``, raising ``InvalidDescriptor`` naming the first row outside."""
        where = self.locate(regions)
        bad = np.flatnonzero(where < 0)
        if bad.size:
            i = int(bad[0])
            a, n, d = (int(x) for x in self.array[i])
            raise InvalidDescriptor(
                f"{bad.size} of {len(self)} {what} fall outside registered {self.kind.value} memory; "
                f"first is row {i}: address {a:#x}, length {n}, device {d}. Register the memory first "
                "(or, for a remote list, ask the peer to register it and re-fetch its metadata)")
        return where
