"""Registration epochs: how a same-host peer learns, without asking, that an
owner's registrations shrank since it loaded the owner's metadata.

Same-host fast paths (shared segments, cross-memory attach, UCX's ``cma``)
copy without the owner's involvement, so an owner cannot refuse a request
from an initiator holding stale metadata.  Each owner therefore keeps a
one-page memfd whose counter it bumps on every deregistration, and
advertises ``(fd, value)`` in its metadata.  A same-host peer maps the page
read-only and, before each same-host copy, compares the counter with the
value its metadata carried: if it moved, the metadata is stale and the copy
must not happen (the host backend falls back to its owner-checked server;
others refuse with ``RemoteRejected``).

The page also orders a deregistration after the copies already under way.
A peer claims a *guard slot* on the page when it maps it and counts its
copies under way there (an atomic increment and a fence before it checks
the counter, a decrement after its last check: no system call); the owner,
after bumping the counter, waits until every slot has read zero once
(``Epoch.drain``).  Each side stores, fences, then loads what the other
stores, so either the copy sees the new counter (and does not happen) or the
owner sees it counted and waits.  A peer without a slot (the pure-Python
copy engine has no atomics; an owner of a kvt before slots; every slot
taken) holds a shared ``flock`` on its own open of the page instead, and the
owner's drain also takes the exclusive lock once.  A slot whose claimant
died is not waited for and is claimed again.

The page also tells whether its owner is alive, without a system call:
the owner's *liveness word* holds the id of a thread of the owner's that
does nothing else (``memcopy.keep_alive``), and the kernel clears it when
that thread exits, however the owner dies (a robust futex).  A peer checks
it after each copy: bytes copied from or into a dead owner must not count.
A peer that finds no id there (the owner's engine is pure Python) polls the
owner's pidfd instead.

The page also vouches for the owner's metadata: the owner writes a digest
of what its metadata says about its memory (``publish``: the region table,
and whatever decides which process a transport reaches, joined by
``table``) at each change, and a peer takes the same-host paths only for
metadata with that digest (``EpochWatch.vouches``; ``vouched_watch``
refuses the rest).  Metadata reaches a peer from wherever it came (a
handshake endpoint named in a request): forged, it could claim another
process's unregistered memory, and those paths ask its owner nothing.  The
page is the owner's word, reached through ``/proc/<pid>/fd``, which only the
owner fills.

Page layout (4 KiB, whatever the system's page size): the counter at byte
0, ``_MAGIC`` at byte 8 when the owner's drain watches slots, the liveness
word (uint32) at byte 20, the table's digest (32 bytes) at byte 32, then 63
slots of 64 bytes (one cache line each) from byte 64: the claimant's tag
(``pid << 32 | n``, 0 when free) and its count of copies under way.

This protects against stale metadata, the honest mistake, and forged
metadata from afar.  It is not a boundary against a hostile process of the
same user: on one host the kernel, not kvt, decides who may read whose
memory (docs/security.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import mmap
import os
import struct
import time

import numpy as np

from . import memcopy
from .errors import PeerDisconnected, WireError
from .procs import is_process

__all__ = ["Epoch", "EpochWatch", "table", "vouched_watch"]

_NAME = "kvt-epoch"
_COUNTER = struct.Struct("=Q")
_PAGE = 4096
_MAGIC = int.from_bytes(b"kvtslot1", "little")  # at byte 8: this owner's drain watches the slots
_SLOTS_AT, _SLOT_BYTES, _NSLOTS = 64, 64, 63
_ALIVE_AT = 20
_DIGEST_AT, _DIGEST = 32, 32  # the region table's digest: where, and its bytes
_TID_MASK, _OWNER_DIED = 0x3FFFFFFF, 0x40000000  # <linux/futex.h>
_PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: a claimant tag naming a larger pid is nobody's
_tags = itertools.count(1)  # n in this process's claimant tags (pid << 32 | n): one per watch
# the page can never shrink: a peer that maps it cannot be made to fault (SIGBUS) on a truncated file
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _digest(table: bytes) -> bytes:
    return hashlib.blake2b(table, digest_size=_DIGEST, person=b"kvt-regions").digest()


def table(*parts: bytes) -> bytes:
    """What an owner vouches for, from the parts of its metadata that say
    what memory it offers and where it runs (each length-prefixed, so no
    two lists of parts join into the same bytes)."""
    return b"".join(len(p).to_bytes(8, "little") + bytes(p) for p in parts)


def _slots(mm: mmap.mmap) -> np.ndarray:
    """(claimant tag, copies under way) per slot: a view of the page."""
    words = np.frombuffer(mm, np.uint64, _NSLOTS * _SLOT_BYTES // 8, _SLOTS_AT)
    return words.reshape(_NSLOTS, _SLOT_BYTES // 8)[:, :2]


def _claimant_alive(tag: int) -> bool:
    pid = tag >> 32
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        pass
    return True


class Epoch:
    """The owner's counter (one per backend instance)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, max(_PAGE, mmap.PAGESIZE))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._mm = mmap.mmap(self.fd, _PAGE, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(self.fd)
            raise
        self._slots = _slots(self._mm)
        self._word = np.frombuffer(self._mm, np.uint64, 1)
        self._addr = self._word.ctypes.data
        self._keeper = None
        if memcopy.atomic_add is not None:  # slots need atomics: a bump, then a fence, then the drain's reads
            struct.pack_into("=Q", self._mm, 8, _MAGIC)
            try:
                self._keeper = memcopy.keep_alive(self.fd, _ALIVE_AT)[1]
            except OSError:  # (peers then poll our pidfd)
                pass

    @property
    def value(self) -> int:
        return _COUNTER.unpack_from(self._mm)[0]

    def publish(self, table: bytes) -> None:
        """Vouch for ``table``, the region table our metadata carries from
        now on (callers serialise, and publish before they hand it out)."""
        self._mm[_DIGEST_AT:_DIGEST_AT + _DIGEST] = _digest(table)

    def bump(self) -> None:
        """Call after a deregistration (callers serialise)."""
        if memcopy.atomic_add is not None:
            memcopy.atomic_add(self._addr, 1)  # a store, then a full fence: before drain reads the slots
        else:
            _COUNTER.pack_into(self._mm, 0, self.value + 1)

    def drain(self, timeout: float) -> bool:
        """After ``bump``: wait until no same-host peer is still inside a copy
        it began before the bump.  False if one still was after ``timeout``
        seconds (a peer stopped mid-copy)."""
        deadline = time.monotonic() + timeout
        locked = False
        busy = np.flatnonzero(self._slots[:, 1]) if memcopy.atomic_add is not None else ()
        while True:
            if not locked:  # the copies of peers without a slot
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                    locked = True
                except BlockingIOError:
                    pass
            # a slot seen at zero once is done: its later copies see the new counter
            busy = [i for i in busy if self._slots[i, 1] and _claimant_alive(int(self._slots[i, 0]))]
            if locked and not busy:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)  # copies run at memory speed

    def close(self) -> None:
        if self.fd >= 0:
            if self._keeper is not None:  # the word cleared now, not when the object goes
                memcopy.stop_alive(self._keeper)
                self._keeper = None
            self._slots = self._word = None  # the mapping cannot close while an array views it
            self._mm.close()
            os.close(self.fd)
            self.fd = -1


class EpochWatch:
    """A peer's view of an owner's page: its counter, and with ``claim_slot``
    our guard slot and its liveness word (the page mapped writable then)."""

    def __init__(self, pid: int, fd: int, seen: int, claim_slot: bool = False):
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        if not os.readlink(path).startswith(f"/memfd:{_NAME}"):
            raise OSError(f"{path} is not a kvt registration epoch")
        slots = claim_slot and memcopy.atomic_cas is not None
        try:  # writable only to claim a guard slot; read-only is enough for the lock
            f = os.open(path, os.O_RDWR if slots else os.O_RDONLY)
        except PermissionError:
            slots, f = False, os.open(path, os.O_RDONLY)
        try:
            # sealed against shrinking (as Epoch makes it): otherwise its owner could truncate it
            # after we mapped it, and our next read of the counter would die of SIGBUS
            if not fcntl.fcntl(f, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise OSError(f"{path} is not sealed against shrinking, as a registration epoch is")
            size = os.fstat(f).st_size
            if size < _DIGEST_AT + _DIGEST:
                raise OSError(f"{path} is too small to be a registration epoch")
            slots = slots and size >= _PAGE
            self._mm = mmap.mmap(f, _PAGE if slots else _DIGEST_AT + _DIGEST, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE if slots else mmap.PROT_READ)
        except BaseException:
            os.close(f)
            raise
        #: our own open file description of the page: the shared lock ``hold`` takes (or native
        #: code given this fd, around its copy) is ours alone
        self.fd = f
        self.seen = seen  #: the value the peer's metadata carried
        self._word = np.frombuffer(self._mm, np.uint64, 1)
        #: where the counter is mapped, for native code that checks it around a copy (valid until close)
        self.address = self._word.ctypes.data
        self._tag = 0
        #: our guard slot's count of copies under way (its address), or 0: take ``fd``'s lock instead
        self.slot = self._claim() if slots and _COUNTER.unpack_from(self._mm, 8)[0] == _MAGIC else 0
        #: the owner's liveness word (its address) and the id it holds while the owner lives; 0, 0:
        #: none (poll the owner's pidfd)
        self.alive = self.tid = 0
        if self.slot:
            word = struct.unpack_from("=I", self._mm, _ALIVE_AT)[0]
            if word & _TID_MASK and not word & _OWNER_DIED:
                self.alive, self.tid = self.address + _ALIVE_AT, word & _TID_MASK

    def _claim(self) -> int:
        """A free slot, else one whose claimant died; 0 if every slot is in use."""
        tag = os.getpid() << 32 | next(_tags) & 0xFFFFFFFF
        table = _slots(self._mm)
        base = table.ctypes.data
        for i in range(_NSLOTS):
            if memcopy.atomic_cas(base + i * _SLOT_BYTES, 0, tag):
                break
        else:
            for i in range(_NSLOTS):
                old = int(table[i, 0])
                if not _claimant_alive(old) and memcopy.atomic_cas(base + i * _SLOT_BYTES, old, tag):
                    # the dead claimant's count stays up forever: ours starts from zero
                    memcopy.atomic_add(base + i * _SLOT_BYTES + 8, -int(table[i, 1]) % (1 << 64))
                    break
            else:
                return 0
        self._tag = tag
        return base + i * _SLOT_BYTES + 8

    @classmethod
    def open(cls, pid: int, fd: int, seen: int, claim_slot: bool = False) -> "EpochWatch | None":
        """The watch, or ``None`` if the page cannot be mapped (then no
        same-host path may trust the metadata).  ``claim_slot``: for a
        peer that will ``hold`` it around its own copies (one of the page's
        63 slots, when one is free and the engine is native)."""
        if not isinstance(fd, int) or fd < 0:
            return None
        try:
            return cls(pid, fd, seen, claim_slot)
        except (OSError, ValueError, TypeError, OverflowError):  # TypeError: pid or fd not a number
            return None

    def vouches(self, table: bytes) -> bool:
        """Whether the owner published ``table`` as its region table: a
        peer's metadata claiming more (or other) memory than the owner
        registered is not taken on one host (tcp, through its server, instead)."""
        return self._mm[_DIGEST_AT:_DIGEST_AT + _DIGEST] == _digest(table)

    def hold(self) -> bool:
        """Before a same-host copy: the owner's ``drain`` now waits for our
        ``release``.  False while the owner is draining (its counter has
        moved: the copy must not happen); True does not say it has not: check
        ``stale`` after ``hold``, as the owner may bump at any time.  One copy
        at a time per watch: the lock belongs to the open file, not the
        thread.  (``memcopy.copy_indexed`` does the same in one call, given
        ``slot``, or ``fd`` as its ``lock``.)"""
        if self.slot:
            memcopy.atomic_add(self.slot, 1)
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if self.slot:
            memcopy.atomic_add(self.slot, (1 << 64) - 1)
        else:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    @property
    def stale(self) -> bool:
        """The owner deregistered memory since the metadata was taken."""
        return _COUNTER.unpack_from(self._mm)[0] != self.seen

    def close(self) -> None:
        """Call with no copy under way (the slot is given back)."""
        if self.slot:
            memcopy.atomic_cas(self.slot - 8, self._tag, 0)
            self.slot = 0
        self._word = None  # the mapping cannot close while an array views it
        self.address = self.alive = 0
        self._mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def vouched_watch(pid: int, start: int, fd: int, seen: int, table: bytes, peer: str) -> EpochWatch:
    """The epoch page of ``peer``, a same-host process whose metadata says
    ``pid``, ``start`` (its start time), epoch ``fd`` and value ``seen``, if
    the owner vouches for ``table`` (see ``table``).  For backends whose
    same-host transport acts on whatever memory the metadata names (UCX's
    cma): ``PeerDisconnected`` if no such process runs, ``WireError`` if its
    page cannot be read or does not vouch for ``table``."""
    if not (isinstance(pid, int) and 0 < pid <= _PID_MAX and is_process(pid, start)):
        raise PeerDisconnected(f"peer {peer!r} (pid {pid} on this host) is not running")
    watch = EpochWatch.open(pid, fd, seen)
    if watch is None:
        raise WireError(f"metadata of {peer!r} names no registration epoch of its process on this host "
                        f"(fd {fd}): it cannot be checked, so it is not used; fetch it again from the agent")
    if not watch.vouches(table):
        watch.close()
        raise WireError(f"metadata of {peer!r} is not what its owner on this host vouches for: forged, or "
                        "taken before the owner registered or deregistered memory; fetch it again from the agent")
    return watch
