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

The page also orders a deregistration after the copies already under way:
a peer holds a shared ``flock`` on its own open of the page while it copies
(``EpochWatch.hold``), and the owner, after bumping the counter, takes the
exclusive lock once (``Epoch.drain``), which waits for every such copy.  A
copy that starts after the bump sees the new value and does not happen.

This protects against stale metadata, the honest mistake.  It is not a
boundary against a hostile process of the same user: on one host the
kernel, not kvt, decides who may read whose memory (docs/security.md).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time

import numpy as np

__all__ = ["Epoch", "EpochWatch"]

_NAME = "kvt-epoch"
_COUNTER = struct.Struct("=Q")
# the page can never shrink: a peer that maps it cannot be made to fault (SIGBUS) on a truncated file
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Epoch:
    """The owner's counter (one per backend instance)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, mmap.PAGESIZE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._mm = mmap.mmap(self.fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(self.fd)
            raise

    @property
    def value(self) -> int:
        return _COUNTER.unpack_from(self._mm)[0]

    def bump(self) -> None:
        """Call after a deregistration (callers serialise: one aligned 8-byte store)."""
        _COUNTER.pack_into(self._mm, 0, self.value + 1)

    def drain(self, timeout: float) -> bool:
        """After ``bump``: wait until no same-host peer is still inside a copy
        it began before the bump.  False if one still was after ``timeout``
        seconds (a peer stopped mid-copy)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.0005)  # copies run at memory speed
                continue
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            return True

    def close(self) -> None:
        if self.fd >= 0:
            self._mm.close()
            os.close(self.fd)
            self.fd = -1


class EpochWatch:
    """A peer's view of an owner's counter, mapped read-only."""

    def __init__(self, pid: int, fd: int, seen: int):
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        if not os.readlink(path).startswith(f"/memfd:{_NAME}"):
            raise OSError(f"{path} is not a kvt registration epoch")
        f = os.open(path, os.O_RDONLY)
        try:
            # sealed against shrinking (as Epoch makes it): otherwise its owner could truncate it
            # after we mapped it, and our next read of the counter would die of SIGBUS
            if not fcntl.fcntl(f, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise OSError(f"{path} is not sealed against shrinking, as a registration epoch is")
            if os.fstat(f).st_size < _COUNTER.size:
                raise OSError(f"{path} is too small to be a registration epoch")
            self._mm = mmap.mmap(f, _COUNTER.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
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

    @classmethod
    def open(cls, pid: int, fd: int, seen: int) -> "EpochWatch | None":
        """The watch, or ``None`` if the page cannot be mapped (then no
        same-host path may trust the metadata)."""
        if not isinstance(fd, int) or fd < 0:
            return None
        try:
            return cls(pid, fd, seen)
        except (OSError, ValueError, TypeError, OverflowError):  # TypeError: pid or fd not a number
            return None

    def hold(self) -> bool:
        """Before a same-host copy: the owner's ``drain`` now waits for our
        ``release``.  False while the owner is draining (its counter has
        moved: the copy must not happen).  One copy at a time per watch: the
        lock belongs to the open file, not the thread.  (``memcopy.copy_indexed``
        does the same in one call, given ``fd`` as its ``lock``.)"""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    @property
    def stale(self) -> bool:
        """The owner deregistered memory since the metadata was taken."""
        return _COUNTER.unpack_from(self._mm)[0] != self.seen

    def close(self) -> None:
        self._word = None  # the mapping cannot close while an array views it
        self.address = 0
        self._mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
