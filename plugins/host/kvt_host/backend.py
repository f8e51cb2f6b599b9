"""``host``: the backend that works on any machine.

Paths, chosen per transfer (see docs/backends/host.md):

* **shm** — the peer is on this host and the remote rows lie in kvt shared
  segments (``kvt.memory.empty``): we map them once and ``memcpy``.
* **cma** — the peer is on this host, other host memory: Linux cross-memory
  attach (``process_vm_readv/writev``), one kernel copy.
* **tcp** — anything else (other hosts, device memory at the peer, or
  ``transport="tcp"``): a request to the peer's server thread, which checks
  the rows against its registrations before touching memory.

Device memory (CUDA or any torch device) is staged through host mirrors.
Each peer has one worker thread, so transfers and notifications to a peer
run in order and a slow peer cannot stall the others.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Mapping

import numpy as np
import zmq
from kvt import extensions, memory, memcopy
from kvt.auth import Secret
from kvt.epoch import Epoch, EpochWatch, table as vouched
from kvt.backend import Backend, HandleTable, Inbox, PeerTable, RegionTable, seconds, take_handle
from kvt.procs import host_id, is_process, start_time
from kvt.errors import (AuthenticationError, ClosedError, ConfigError, HandshakeError, HandshakeTimeout,
                        InvalidArgument, InvalidDescriptor, KvtError, KvtTimeoutError, PeerDisconnected,
                        RemoteRejected, TransferError, TransferTimeout, WireError)
from kvt.handshake import check_bind, connect
from kvt.types import (SETTLED, Availability, Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle,
                       XferHandle, XferState, as_index)
from kvt.wire import decode, encode

from . import memops
from .notifs import NotifLink, valid_name
from .protocol import MAX_MESSAGE_BYTES, MAX_NAME, MAX_SEGMENTS, HostMetadata, Reply, Request, chunks, rows_of
from .server import Server
from .stream import Stream
from .staging import Mirrors

log = logging.getLogger(__name__)

_TRANSPORTS = ("auto", "cma", "tcp")
_LIVE: "weakref.WeakValueDictionary[str, HostBackend]" = weakref.WeakValueDictionary()  # by server endpoint
_POLL = 0.05  # seconds between liveness checks while waiting on a peer
_STREAM_RETRY = 5.0  # seconds of ZMQ messages after a peer's stream slots were full


# the same-host post's common case in C (kvt_host/_fastpath.c); HostBackend._transfer is its pure-Python
# twin and takes every other case (KVT_NATIVE=0 forces it, as for kvt's own; it also needs kvt's copy engine)
_fastpath, _POST_PATH = extensions.load("kvt_host._fastpath", "kvt-host", "pure-Python post path",
                                        None if memcopy.ENGINE == "native" else
                                        f"kvt's native copy engine ({memcopy.ENGINE_REASON})")


class _PyPrepCore:
    __slots__ = ("peer", "descs", "mapped", "addrs", "lengths", "owner", "gen", "inc")


class _PyLaneCore:
    """_Lane's claim on the caller's side (LaneCore in C)."""

    __slots__ = ("_claim", "_busy", "_here")

    def enter(self) -> bool:
        """Claim the idle lane for work on the caller's thread (then ``leave``)."""
        # _busy read twice without the lock: a job queued after the second read waits for our claim,
        # one queued before it makes us back off (a caller never runs ahead of queued work)
        if self._busy or not self._claim.acquire(False):
            return False
        if self._busy:
            self._claim.release()
            return False
        self._here = True
        return True

    def leave(self) -> None:
        self._here = False
        self._claim.release()


class _PyHostCore:
    __slots__ = ()


_PrepCore, _LaneCore, _HostCore = (_PyPrepCore, _PyLaneCore, _PyHostCore) if _fastpath is None else \
    (_fastpath.PrepCore, _fastpath.LaneCore, _fastpath.HostCore)


class _Prep(_PrepCore):
    """A prepped list.  ``mapped``: our addresses of a peer's rows in its
    shared segments.  For the one-call same-host path (``_copy_here``):
    ``addrs``, host addresses we can copy at, and ``lengths``, their lengths
    (one int if uniform); ``owner`` and ``gen``, the peer and mapping
    generation the addresses belong to (``RETIRED`` for a list of our own
    memory deregistered since: refused); ``inc``, the peer's incarnation whose
    registrations the rows were checked against."""

    __slots__ = ()

    def __init__(self, peer: str | None, descs: Descs, mapped: np.ndarray | None = None, owner: "_Peer | None" = None,
                 gen: int = 0, inc: tuple | None = None):
        self.peer, self.descs, self.mapped, self.owner, self.gen, self.inc = peer, descs, mapped, owner, gen, inc
        self.addrs = self.lengths = None


#: ``_Prep.gen`` of a list of our own memory that was deregistered: transfers with it are refused
RETIRED = -1

_settle = threading.Lock()  # guards every job's state and waiter: held for a few instructions only


class _Job:
    """One posted transfer.  Its state settles once (first outcome wins:
    completion vs cancellation); a waiter blocks on ``event``, made only
    when someone waits on a job still in flight."""

    __slots__ = ("op", "lrows", "lkind", "rrows", "rkind", "notif", "peer", "rmapped", "rgen", "rinc", "state",
                 "future", "event", "nbytes", "indexed", "stream")

    def __init__(self, op: Op, lrows: np.ndarray, lkind: MemKind, rrows: np.ndarray, rkind: MemKind,
                 notif: bytes | None, peer: "_Peer | None", rmapped: np.ndarray | None = None):
        self.op, self.lrows, self.lkind, self.rrows, self.rkind = op, lrows, lkind, rrows, rkind
        self.notif, self.peer = notif, peer
        self.rmapped = rmapped  # remote rows, mapped into our address space (shm path)
        self.rgen = 0  # the peer's mapping generation rmapped belongs to (void once it moved)
        self.rinc = None  # the peer incarnation rrows were checked against (another: its server judges them)
        self.state = XferState.PROC
        self.indexed = None  # (lp, li, rp, ri, lengths, checked): queued for the one-call path
        self.future = None
        self.event: threading.Event | None = None
        self.stream: Stream | None = None  # the data stream its bytes are moving on, if any (release cuts it)

    def finish(self, state: XferState) -> None:
        with _settle:
            if not self.state.pending:
                return
            self.state, event = state, self.event
        if event is not None:
            event.set()

    def wait(self, timeout: float) -> XferState:
        with _settle:
            if not self.state.pending:
                return self.state
            if self.event is None:
                self.event = threading.Event()
            event = self.event
        event.wait(timeout)
        return self.state


_I64 = np.dtype(np.int64)
_NO_LIMIT = (1 << 64) - 1


_DONE = _Job(Op.READ, None, MemKind.DRAM, None, MemKind.DRAM, None, None)
_DONE.state = XferState.DONE  # what SETTLED (a transfer settled inline) stands for in the transfer table


def _held(peer: "_Peer | None", copy, *args):
    """``copy(*args)`` between our memory and same-host ``peer``'s, which
    its ``deregister`` waits for (``EpochWatch.hold``: the caller may free
    the memory when it returns); ``None``, nothing copied, while that peer
    is deregistering.  Call holding the peer's lane (one copy per watch)."""
    if peer is None:
        return copy(*args)
    if not peer.epoch.hold():
        return None
    try:
        out = copy(*args)
        return True if out is None else out
    finally:
        peer.epoch.release()


def _unless_stale(peer: "_Peer", copy, *args) -> bool:
    """``copy(*args)`` unless the owner's epoch moved, checked inside ``_held``:
    a deregistration that bumped it before our hold did not wait for this copy."""
    if peer.epoch.stale:
        return False
    copy(*args)
    return True


class _Lane(_LaneCore):
    """One worker thread, plus the right to run a job on the caller's thread
    instead when the lane is idle: small same-host copies then skip a thread
    hand-off, and jobs on a lane still never overlap (so they stay in order,
    share the lane's socket safely, and a peer's teardown, itself a job,
    never runs under a copy using its mappings or epoch page)."""

    def __init__(self, name: str, limit: float):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._busy = 0  # jobs queued or running
        # held by whoever runs on the lane: its worker for each job, or a caller between enter and
        # leave; a caller only tries it (never waits), the worker waits for a caller's one request
        self._claim = threading.Lock()
        self._here = False  # a caller holds _claim
        self._limit = limit  # longest a caller may hold it: one request, bounded by the backend's timeout

    def submit(self, fn, *args):
        with self._lock:
            self._busy += 1
        try:
            return self.pool.submit(self._counted, fn, *args)
        except RuntimeError:
            self._done()
            raise

    def _counted(self, fn, *args):
        held = self._claim.acquire(timeout=self._limit)  # (not had after the limit: runs anyway, as before)
        try:
            return fn(*args)
        finally:
            if held:
                self._claim.release()
            self._done()

    def wait_caller(self) -> bool:
        """Wait until no caller holds the lane (none can start once a job is
        queued); False if one still did after the limit.  On the lane's
        worker (a job) no caller can hold it: True at once."""
        if not self._here:
            return True
        if self._claim.acquire(timeout=self._limit):
            self._claim.release()
            return True
        return False

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1

    def cancel(self, future) -> bool:
        """Cancel a queued job; False if it already started."""
        if future.cancel():
            self._done()
            return True
        return False


_NO_SEGS = (Descs.from_regions(np.zeros(0, np.uint64), np.zeros(0, np.uint64)), np.zeros(0, np.uint64))


def _incarnation(md: HostMetadata) -> tuple:
    """What changes when a peer restarts (same name, new process)."""
    return md.host_id, md.pid, md.start_time, md.endpoint


class _Peer:
    """What we know of a remote agent, and the lane that talks to it."""

    def __init__(self, md: HostMetadata, transport: str, secret: Secret | None = None, timeout: float = 30.0):
        self.name, self.lane = md.name, _Lane(f"kvt-host->{md.name}", timeout + 1)
        self._sock: zmq.Socket | None = None
        self.secret, self.timeout = secret, timeout
        self.session = None  # kvt.auth.ClientSession of the socket, with a secret
        self.stream: Stream | None = None  # the tcp path's data stream (kvt_host.stream), opened on first use
        self.streams = True                # False once the peer's server turned streams down (an older kvt)
        self.stream_after = 0.0            # monotonic time before which no stream is asked for (slots were full)
        self._pidfd: int | None = None
        self._maps: dict[int, tuple[int, int]] = {}  # remote segment base -> (local address, size)
        self.gen = 0  # bumped when the mappings go: preps holding their addresses are then void
        self._segs = _NO_SEGS  # (remote segment rows, our addresses of them): see mapped()
        self.epoch: EpochWatch | None = None
        self.link: NotifLink | None = None  # its notification socket (kvt_host.notifs): same host, no secret
        self.notifs_on_zmq = False  # set for good once one went over ZMQ: one channel keeps them in order
        try:
            self.update(md, transport)
        except BaseException:
            self.close()  # what it mapped or opened before it failed
            raise

    def update(self, md: HostMetadata, transport: str) -> None:
        regions, segs = _checked(md)
        if (self._maps or self._sock is not None or self.link is not None) \
                and _incarnation(md) != _incarnation(self.md):
            self.close()  # a restarted peer: its old segments, server and notification socket are gone
        self.md, self.regions = md, regions
        # on this host we can watch the peer's process; shm/cma also need transport != tcp
        self.local_pid = md.host_id == host_id() and is_process(md.pid, md.start_time)
        self.same_host = self.local_pid and transport != "tcp"
        if self.same_host and self.secret is None and self.link is None and not self.notifs_on_zmq \
                and valid_name(md.notif):
            self.link = NotifLink(md.notif)
        self._watch(md.pid if self.local_pid else None)
        if self.epoch is not None:
            self.epoch.close()
        # same-host paths bypass the owner's server: without its epoch we could not tell stale metadata
        self.epoch = EpochWatch.open(md.pid, md.epoch_fd, md.epoch, claim_slot=True) if self.same_host else None
        if self.epoch is not None and not self.epoch.vouches(vouched(md.regions.get(MemKind.DRAM.value, b""),
                                                                      md.segments)):
            # not the tables the owner published: forged (wider regions, shifted segments) or changed
            # since; its server judges every row instead
            log.debug("metadata of %r is not what its owner vouches for; taking tcp", md.name)
            self.epoch.close()
            self.epoch = None
        self.same_host = self.epoch is not None
        self.cma_ok = self.same_host
        self.failed: TransferError | None = None  # set when it dies or stops answering; cleared by fresh metadata
        self.inc = _incarnation(md)  # after regions: prep reads it before them (see prep)
        if self.same_host and transport == "auto":
            for base, size, fd in segs.tolist():
                if base not in self._maps:
                    try:  # the size we map is the file's own (fstat), never more than it holds
                        self._maps[base] = memops.mmap_fd(f"/proc/{md.pid}/fd/{fd}", size)
                    except OSError:
                        pass  # not allowed to map it (or smaller than claimed): cma or tcp will do
        bases = np.array(list(self._maps), np.uint64)
        sizes = np.array([s for _, s in self._maps.values()], np.uint64)
        # one assignment: prep (any thread) reads a consistent pair
        self._segs = (Descs.from_regions(bases, sizes), np.array([a for a, _ in self._maps.values()], np.uint64))

    def mapped(self, rows: np.ndarray) -> np.ndarray | None:
        """Our addresses for remote ``rows`` if all lie in mapped segments
        (read ``gen`` first: they hold while it stays)."""
        seg_rows, seg_local = self._segs
        if not len(seg_rows):
            return None
        where = Descs(rows).locate(seg_rows)
        if (where < 0).any():
            return None
        return seg_local[where] + (rows[:, 0] - seg_rows.addrs[where])

    def alive(self) -> bool:
        if not self.local_pid:
            return True  # another host: only a timeout tells
        if self._pidfd is not None:  # a pidfd turns readable when the process exits: one cheap syscall
            exited = select.poll()  # per call: a poll object must not be polled from two threads at once
            exited.register(self._pidfd, select.POLLIN)
            return not exited.poll(0)
        return is_process(self.md.pid, self.md.start_time)

    def _watch(self, pid: int | None) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd = None
        if pid is not None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:
                return  # old kernel or not allowed: fall back to /proc
            if not is_process(pid, self.md.start_time):  # it died (and the pid was reused) in between
                self.local_pid = self.same_host = False

    def socket(self) -> zmq.Socket:
        if self._sock is None:  # created and used only on this peer's worker thread
            try:  # with a secret, both sides prove the key before any request goes out
                # (a reply holds at most one request's data)
                self._sock, self.session = connect(zmq.DEALER, self.md.endpoint, self.secret, self.timeout,
                                                   f"peer {self.name!r}", max_msg_bytes=MAX_MESSAGE_BYTES, covered=1,
                                                   settle=False)
            except HandshakeError as e:
                cls = (RemoteRejected if isinstance(e, AuthenticationError) else
                       TransferTimeout if isinstance(e, HandshakeTimeout) else TransferError)
                raise cls(f"{e}") from e
        return self._sock

    def seal(self, frames: list) -> list:
        """``frames`` with their auth frame appended, once ``socket()`` opened a session."""
        if self.session is not None:
            frames.append(self.session.seal(frames))
        return frames

    def open(self, frames: list) -> list | None:
        """A reply's frames once checked (None: a late reply to an earlier request)."""
        if self.session is None:
            return frames
        try:
            return self.session.open(frames, f"peer {self.name!r}")
        except AuthenticationError as e:
            self.drop_socket()  # the next request opens a new session (e.g. the peer forgot ours)
            raise RemoteRejected(str(e)) from e

    def drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self.session = None, None

    def close(self) -> None:
        """On its lane's worker (or once the lane is shut down): no copy is using what goes."""
        self.gen += 1
        self.same_host = self.cma_ok = False
        self.failed = PeerDisconnected(f"peer {self.name!r} was removed (or its agent closed); "
                                       "add its metadata again and retry")
        self._segs = _NO_SEGS
        if not self.lane.wait_caller():  # a caller still copies with them (should not happen): leave them be
            self._maps.clear()
            self.epoch, self._pidfd = None, None
        self._watch(None)
        if self.epoch is not None:
            self.epoch.close()
            self.epoch = None
        self.drop_socket()
        self.drop_stream()
        if self.link is not None:
            self.link.close()
        self.link, self.notifs_on_zmq = None, False
        for addr, size in self._maps.values():
            memops.munmap(addr, size)
        self._maps.clear()


    def drop_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


def _checked(md: HostMetadata) -> tuple[dict[MemKind, Descs], np.ndarray]:
    """A peer's region and segment tables, validated (``WireError``): known
    kinds, no empty or wrapping rows, and never our own process, so forged
    metadata cannot turn our cma/shm paths on our own memory."""
    try:
        regions = {MemKind(k): Descs(rows_of(v), k) for k, v in md.regions.items()}
        for kind, d in regions.items():
            d.check_rows(f"{kind.value} regions")
        segs = rows_of(md.segments)
        Descs.from_regions(segs[:, 0], segs[:, 1]).check_rows("segments", max_rows=MAX_SEGMENTS)
    except (ValueError, KvtError) as e:
        raise WireError(f"bad region table in metadata of {md.name!r}: {e}") from e
    if len(np.unique(segs[:, 2])) != len(segs):  # one fd is one segment: listed twice, it would be mapped twice
        raise WireError(f"metadata of {md.name!r} lists one segment fd under two addresses")
    if len(md.name) > MAX_NAME or not md.name:
        raise WireError(f"peer name must be 1 to {MAX_NAME} characters")
    if not md.endpoint.startswith("tcp://") or len(md.endpoint) > MAX_NAME:
        raise WireError(f"peer {md.name!r} advertises endpoint {md.endpoint[:80]!r}; expected tcp://host:port")
    if md.pid == os.getpid() and md.host_id == host_id():
        # a peer in this very process is real only if it is a live backend here, and then its
        # claimed memory must be memory it registered: else forged metadata would aim our
        # cma/shm paths at our own unregistered memory
        twin = _LIVE.get(md.endpoint)
        if twin is None or twin.agent_name != md.name or any(
                (d.locate(twin._regions.of(k)) < 0).any() for k, d in regions.items()):
            raise WireError(f"metadata of {md.name!r} claims this very process (pid {md.pid}) but no such "
                            "agent lives here with that memory; refused")
    if not 0 < md.pid < 1 << 22:
        raise WireError(f"metadata of {md.name!r} carries pid {md.pid}, not a Linux pid")
    return regions, segs


class HostBackend(_HostCore, Backend):
    """Host-buffer staging over shared memory, cross-memory attach or TCP.

    Options: ``timeout`` (s, default 30), ``transport`` (``auto`` | ``cma`` |
    ``tcp``), ``listen_host`` (default 127.0.0.1), ``advertise_host``
    (address peers dial; default ``listen_host``).
    """

    uses_auth_key = True  # its data server and peer sockets are authenticated with the agent's auth_key
    option_names = frozenset({"transport", "listen_host", "advertise_host", "inline_bytes"})  # docs/backends/host.md
    post_path = extensions.summary(_fastpath, _POST_PATH)  # same-host requests
    capabilities = Capabilities(mem_kinds=frozenset(MemKind), ops=frozenset(Op), notifications=True,
                                local=True, remote=True, cross_host=True, max_notif_bytes=1 << 20,
                                cross_host_options={"transport": "tcp"}, owner_check="server",
                                stops_on_err=True)  # a late answer is dropped; a timed-out stream is closed

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, f"needs Linux (/proc, memfd); this is {sys.platform}")
        return Availability(True)

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        super().__init__(agent_name, options)
        self.transport = self.options.get("transport", "auto")
        if self.transport not in _TRANSPORTS:
            raise ConfigError(f"host backend option 'transport' must be one of {_TRANSPORTS}, got {self.transport!r}")
        listen = self.options.get("listen_host", "127.0.0.1")
        advertise = self.options.get("advertise_host", listen)
        for option, host in (("listen_host", listen), ("advertise_host", advertise)):
            try:  # (peers dial the advertised one: a number or a lone surrogate there broke our metadata)
                check_bind(host, 0)
            except InvalidArgument as e:
                raise ConfigError(f"host backend option {option!r}: {e}") from None
        self._lock = threading.RLock()
        self._regions = RegionTable()
        self._mirrors = Mirrors()
        self._preps = HandleTable("prepped descriptor list")
        self._xfers = HandleTable("transfer", settled=_DONE)
        self._peers = PeerTable()  # name -> _Peer
        self._inbox = Inbox()
        #: transfers up to this many bytes between host memory on this host run in the calling thread
        inline = self.options.get("inline_bytes", 16 << 20)
        if isinstance(inline, bool) or not isinstance(inline, int) or not 0 <= inline <= 1 << 40:
            raise ConfigError(f"host backend option 'inline_bytes' must be a whole number of bytes (0 turns "
                              f"inline copies off), got {inline!r}")
        self.inline_bytes = inline
        self._local = _Lane("kvt-host-local", self.timeout + 1)
        self._epoch = Epoch()
        self._epoch.publish(vouched(b"", b""))  # nothing registered yet
        key = self.options.get("auth_key")  # set by the Agent from configuration auth_key
        self._secret = None if key is None else Secret(key)
        try:
            self._server = Server(self, listen, advertise, self._secret)
        except BaseException as e:
            self._local.pool.shutdown(wait=False)  # (its thread starts with its first job: none yet)
            self._epoch.close()
            if isinstance(e, HandshakeError):  # RouterServer's bind failure
                raise ConfigError(f"host backend: {e}; set option 'listen_host'") from e
            raise
        _LIVE[self._server.endpoint] = self

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Any) -> RegHandle:
        self._check_open()
        descs = Descs.coerce(mem)
        self._check_kind(descs.kind)
        h = self._next_id()
        with self._lock:
            if descs.kind is not MemKind.DRAM:
                self._mirrors.add(h, descs)
            self._regions.add(h, descs)
            self._publish()
        return RegHandle(h)

    def _tables(self) -> tuple[dict[MemKind, Descs], np.ndarray]:
        """Our region tables and the shared segments of our host memory, as
        our metadata carries them (call holding our lock)."""
        return self._regions.by_kind(), memory.segments_of(self._regions.of(MemKind.DRAM))

    def _publish(self) -> None:
        """Vouch on our epoch page for the tables our metadata carries from now
        on: a same-host peer takes its direct paths only for metadata with
        these (kvt.epoch; forged metadata may claim more of us)."""
        regions, segs = self._tables()
        dram = regions.get(MemKind.DRAM)
        self._epoch.publish(vouched(b"" if dram is None else dram.array.tobytes(), segs.tobytes()))

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        with self._lock:
            descs = self._regions.remove(handle)
            self._epoch.bump()  # same-host peers holding our old metadata stop copying behind our back
            for p in list(self._preps.values()):  # lists of it: refused from now on (both post paths)
                if p.peer is None and p.descs.kind is descs.kind and self._regions.lost(descs, p.descs.array):
                    p.gen, p.addrs = RETIRED, None
            # copies still running from or into it end first (same-host peers', our server's and our own
            # transfers'): the caller frees it next
            drained = self._epoch.drain(self.timeout) and self._server.inflight.drain(descs, self.timeout) \
                and self._stop_jobs_on(descs)
            self._mirrors.remove(handle)
            self._publish()
        if not drained:
            raise KvtTimeoutError(f"a request still used the deregistered memory after {self.timeout:g}s; "
                                  "do not free it yet (this should not happen: report it)")

    def _stop_jobs_on(self, descs: Descs) -> bool:
        """Our own transfers still moving bytes to or from ``descs`` (just
        deregistered, and not registered otherwise) end as ERR (as on
        ``release``: queued ones never start, a stream is cut); True once
        none of them copies any more, nor a caller's inline copy."""
        cause = TransferError("its memory was deregistered while it was under way; register it again and retry")
        futures = []
        for job in list(self._xfers.values()):  # a copy: posts add to it without our lock
            if job is _DONE or not job.state.pending or not self._lost(job, descs):
                continue
            job.finish(XferState.err(cause))
            with _settle:
                if job.stream is not None:
                    job.stream.abort()
            lane = job.peer.lane if job.peer else self._local
            if job.future is not None and not lane.cancel(job.future):
                futures.append(job.future)
        if futures and wait(futures, timeout=self.timeout + 1).not_done:
            return False
        # a copy on a caller's thread (inline: no job, or one not queued) holds its lane meanwhile
        return all(lane.wait_caller() for lane in [self._local, *(p.lane for p in self._peers.values())])

    def _lost(self, job: _Job, descs: Descs) -> bool:
        """Whether ``job`` moves bytes of ours that ``descs`` held and no
        registration holds now (both of its sides are ours when it has no peer)."""
        if job.indexed is not None and job.lrows is None:  # queued for the one-call path: rows by index
            lp, li, rp, ri, _, _ = job.indexed
            ours = [(lp.descs.kind, lp.descs.array[li])] + ([(rp.descs.kind, rp.descs.array[ri])] if job.peer is None
                                                            else [])
        else:
            ours = [(job.lkind, job.lrows)] + ([(job.rkind, job.rrows)] if job.peer is None else [])
        return any(kind is descs.kind and rows is not None and self._regions.lost(descs, rows) for kind, rows in ours)

    # -- peers ----------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        with self._lock:  # the tables _publish vouched for
            regions, segs = self._tables()
        pid = os.getpid()
        return encode(HostMetadata(
            name=self.agent_name, endpoint=self._server.endpoint, host_id=host_id(), pid=pid,
            start_time=start_time(pid), regions={k.value: d.array.tobytes() for k, d in regions.items()},
            segments=segs.tobytes(), epoch_fd=self._epoch.fd, epoch=self._epoch.value,
            notif="" if self._server.notifs is None else self._server.notifs.name))

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        md = decode(metadata, HostMetadata)
        if md.name == self.agent_name:
            raise InvalidArgument(f"metadata is this agent's own ({md.name!r}); local transfers use prep(None, ...)")
        with self._lock:  # (close takes it too: no peer is added behind its back)
            self._check_open()
            peer = self._peers.get(md.name)
            if peer is None:
                self._peers[md.name] = _Peer(md, self.transport, self._secret, self.timeout)
                return md.name
            if _incarnation(md) != _incarnation(peer.md):
                self._fail_jobs(peer, PeerDisconnected(f"peer {md.name!r} restarted (new process); "
                                                       "this transfer was meant for the old one"))
            try:  # on the peer's worker, between its transfers (never under a copy using what it replaces)
                update = peer.lane.submit(peer.update, md, self.transport)
            except RuntimeError:  # its lane is shut down: being removed or closed by another thread
                raise PeerDisconnected(f"peer {md.name!r} was removed while it was being added again; "
                                       "add it again") from None
        try:  # waited for outside our lock: other peers' calls go on meanwhile
            update.result(timeout=2 * self.timeout + 2)
        except FuturesTimeout:
            raise KvtTimeoutError(f"peer {md.name!r} stayed busy for {2 * self.timeout + 2:g}s; "
                                  "its metadata was not refreshed: add it again") from None
        return md.name

    def remove_remote(self, peer: str) -> None:
        self._check_open()
        with self._lock:
            self._check_open()
            p = self._peers.remove(peer)
            self._fail_jobs(p, PeerDisconnected(f"peer {peer!r} was removed; add its metadata again and retry"))
        done = p.lane.submit(p.close)  # after its running job (cut short above) and a caller's copy
        p.lane.pool.shutdown(wait=False)
        try:  # when we return, nothing more of its transfers lands, here or there
            done.exception(timeout=2 * self.timeout + 2)  # (a teardown that failed still leaves it unused)
        except FuturesTimeout:
            raise KvtTimeoutError(f"peer {peer!r} is removed, but a transfer to it was still running after "
                                  f"{2 * self.timeout + 2:g}s (this should not happen: report it)") from None

    def _fail_jobs(self, peer: _Peer, cause: TransferError) -> None:
        for job in list(self._xfers.values()):  # a copy: posts add to it without our lock
            if job.peer is peer:
                job.finish(XferState.err(cause))
                with _settle:  # a stream move stops now, as on release
                    if job.stream is not None:
                        job.stream.abort()

    # -- transfers ------------------------------------------------------------

    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        descs = self._prep_descs(descs)
        owner = None if peer is None else self._peers.named(peer)
        inc = None if owner is None else owner.inc  # before its regions: a restart meanwhile leaves it old, never new
        self._within(descs, self._regions.of(descs.kind) if owner is None else owner.regions.get(descs.kind), peer)
        # translate once here, so the shm path costs no lookup per transfer; the generation first:
        # if the mappings go meanwhile, it is already old and the addresses are never used
        gen = 0 if owner is None else owner.gen
        mapped = owner.mapped(descs.array) if owner is not None and descs.kind is MemKind.DRAM else None
        p = _Prep(peer, descs, mapped, owner=owner, gen=gen, inc=inc)
        if descs.kind is MemKind.DRAM and (owner is None or mapped is not None):
            p.addrs = np.ascontiguousarray(descs.addrs if owner is None else mapped, np.uint64)
            uniform = descs.uniform_length
            p.lengths = uniform if uniform is not None else np.ascontiguousarray(descs.lengths)
        h = self._next_id()
        self._preps[h] = p
        return PrepHandle(h)

    def _transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle,
                  remote_idx: Any, notif: bytes | None = None) -> XferHandle:
        if self._closed:
            self._check_open()
        if type(op) is Op:
            if notif is not None:
                op = self._check_op(op, notif)
                notif = bytes(notif)
            h = self._copy_here(op, local_prep, local_idx, remote_prep, remote_idx, notif)
            if h is not None:
                return h
        op = self._check_op(op, notif)
        lp, rp = self._preps[local_prep], self._preps[remote_prep]
        if lp.peer is not None:
            raise InvalidArgument("local_prep must come from prep(None, ...): it describes our own memory")
        if lp.gen == RETIRED or rp.peer is None and rp.gen == RETIRED:
            raise InvalidDescriptor("a prepped list of this transfer covers memory deregistered since it was "
                                    "prepped: release it, and prep the memory registered now")
        peer = None if rp.peer is None else self._peers[rp.peer]
        li, ri, lrows, rrows = self._pair_indexed(lp.descs, local_idx, rp.descs, remote_idx)
        # mapped addresses only of this very peer object (not of one removed and added again)
        job = _Job(op, lrows, lp.descs.kind, rrows, rp.descs.kind, None if notif is None else bytes(notif), peer,
                   None if rp.mapped is None or rp.owner is not peer else rp.mapped[ri])
        job.rgen, job.rinc = rp.gen, rp.inc
        uniform = lp.descs.uniform_length
        job.nbytes = len(li) * uniform if uniform is not None else int(lrows[:, 1].sum())
        h = self._next_id()
        self._xfers[h] = job
        lane = peer.lane if peer else self._local
        if job.nbytes <= self.inline_bytes and lane.enter():
            try:  # holding the lane: the peer's state cannot change under the check and the copy
                inline = self._inline_ok(job)
                if inline:
                    self._run(job)
            finally:
                lane.leave()
            if inline:
                return XferHandle(h)
        self._submit(lane, job, rp.peer)
        return XferHandle(h)

    if _fastpath is None:  # else HostCore's, which hands what it does not cover to this
        transfer = _transfer

    def _submit(self, lane: _Lane, job: _Job, peer: str | None) -> None:
        try:
            job.future = lane.submit(self._run, job)
        except RuntimeError:  # the worker was shut down (remove_remote or close) in between
            job.finish(XferState.err(self._gone(peer)))

    def _gone(self, peer: str | None) -> KvtError:
        if self._closed or peer is None:
            return ClosedError(f"backend {type(self).__name__} of agent {self.agent_name!r} is closed")
        return PeerDisconnected(f"peer {peer!r} was removed; add its metadata again and retry")

    def _copy_here(self, op: Op, local_prep, local_idx, remote_prep, remote_idx,
                   notif: bytes | None = None) -> XferHandle | None:
        """A same-host request between host memory, as one call of the copy
        engine (index checks, copy, epoch and liveness guards): on the
        caller's thread and ``SETTLED`` before it returns when the lane is idle
        and it is at most ``inline_bytes``, else checked here and queued for
        the same call on the lane's worker.  A notification goes out after
        the copy (``_notif_now``, else from the lane's worker).  ``None`` when the general path
        must take it (remote rows outside mapped segments, device memory, a
        stale epoch, a bad argument: that path then raises the typed error)."""
        try:
            lp, rp = self._preps.get(local_prep), self._preps.get(remote_prep)
        except TypeError:  # unhashable: not a handle
            return None
        if lp is None or rp is None or lp.addrs is None or rp.addrs is None or lp.peer is not None:
            return None
        li = local_idx if type(local_idx) is np.ndarray and local_idx.dtype == _I64 else \
            as_index(local_idx, len(lp.addrs), "local_idx")
        ri = remote_idx if type(remote_idx) is np.ndarray and remote_idx.dtype == _I64 else \
            as_index(remote_idx, len(rp.addrs), "remote_idx")
        ln, rn = lp.lengths, rp.lengths
        if type(ln) is int and type(rn) is int and ln == rn:
            checked = None  # every row of both tables has one length: pairs match
        else:
            ln, rn = lp.descs.lengths, rp.descs.lengths
            checked = rn if op is Op.READ else ln
        peer = rp.owner
        lane = self._local if peer is None else peer.lane
        job = None
        if lane.enter():
            try:  # holding the lane: the peer's mappings, epoch page and pidfd stay as they are
                guards = self._guards(peer, rp)
                if guards is None:
                    return None
                # encoded before the copy, which leaves this core's caches cold for it
                frame = None if notif is None or peer is None else self._notif_frame(notif)
                try:  # (the copy is counted in our slot on the peer's epoch page, or holds its lock: its
                    # deregister waits for it)
                    got = self._copy_indexed(op, (lp, li, rp, ri, ln, checked), self.inline_bytes, *guards)
                except (IndexError, ValueError, TypeError, OverflowError):
                    return None  # the general path checks again and names the problem
                # the common case: copied, and the copy engine checked the owner lives
                out = SETTLED if got >= 0 and (peer is None or guards[2] >= 0 or guards[5]) else \
                    self._after_copy(got, op, peer, guards[2])
                if out is None and got == memcopy.STALE:
                    return None  # nothing copied: the owner's server judges a stale request
                if out is not None and out is not SETTLED:
                    return out  # copied, but it does not count: a failed transfer
                job = None if out is None else _DONE  # (None: TOO_BIG, nothing copied: queued below)
                if job is _DONE and notif is not None and peer is not None and self._notif_now(peer, frame):
                    notif = None
            finally:
                lane.leave()
        else:  # queued work first (jobs on a lane stay in order): check the request now, copy on the worker
            if peer is not None and self._peers.get(peer.name) is not peer:
                return None  # a prep of a peer since removed (maybe added again): the general path looks it up
            try:
                got = self._copy_indexed(op, (lp, li, rp, ri, ln, checked), 0, 0, 0, -1, -1, 0, 0, 0)
            except (IndexError, ValueError, TypeError, OverflowError):
                return None
            job = _DONE if got == 0 else None  # 0: nothing to move; else TOO_BIG, nothing copied
        if job is None:  # too large to copy here, or the lane is busy: the worker runs the same call
            job = _Job(op, None, MemKind.DRAM, None, MemKind.DRAM, notif, peer)
            job.indexed = (lp, li, rp, ri, ln, checked)
            h = self._next_id()
            self._xfers[h] = job
            self._submit(lane, job, rp.peer)
            return h
        if job is _DONE and notif is not None:  # the bytes are in place: now the notification
            if peer is None:
                self._send_notif(None, notif)
            else:
                try:
                    lane.submit(self._send_notif, peer, notif)
                except RuntimeError:  # the peer's worker was shut down (remove_remote or close) in between
                    job = _Job(op, None, MemKind.DRAM, None, MemKind.DRAM, None, peer)
                    job.state = XferState.err(self._gone(rp.peer))
        if job is _DONE:  # every byte in place: nothing to keep, poll or free
            return SETTLED
        h = self._next_id()
        self._xfers[h] = job
        return h

    def _after_copy(self, got: int, op: Op, peer: "_Peer | None", pidfd: int) -> XferHandle | int | None:
        """What ``copy_indexed``'s outcome ``got`` makes of a one-call request
        (call holding the lane: the liveness check reads the peer's pidfd):
        ``SETTLED`` if its bytes count, the handle of a failed transfer if
        they were copied but do not, ``None`` if nothing was copied (``STALE``,
        ``TOO_BIG``: the caller takes the request another way)."""
        try:
            return SETTLED if self._copied(got, op, peer, pidfd) else None
        except TransferError as e:
            job = _Job(op, None, MemKind.DRAM, None, MemKind.DRAM, None, peer)
            job.state = XferState.err(e)
            h = self._next_id()
            self._xfers[h] = job
            return XferHandle(h)

    def _guards(self, peer: "_Peer | None", rp: _Prep) -> tuple | None:
        """``copy_indexed``'s guards (epoch address, seen value, pidfd, epoch
        lock fd, guard slot, liveness word, its id) for a one-call copy to
        ``peer``, or ``None`` if its prepped addresses no longer hold (call
        holding its lane: one copy at a time per watch)."""
        if peer is None:
            return 0, 0, -1, -1, 0, 0, 0
        if peer.gen != rp.gen or not peer.same_host or peer.failed is not None or self._peers.get(peer.name) is not peer:
            return None
        w = peer.epoch
        return w.address, w.seen, -1 if peer._pidfd is None else peer._pidfd, w.fd, w.slot, w.alive, w.tid

    @staticmethod
    def _copy_indexed(op: Op, req: tuple, max_bytes: int, epoch: int, seen: int, pidfd: int, lock: int, slot: int,
                      alive: int, tid: int, threads: int = memcopy.THREADS) -> int:
        lp, li, rp, ri, ln, checked = req
        if op is Op.READ:
            return memcopy.copy_indexed(lp.addrs, li, rp.addrs, ri, ln, checked, max_bytes, epoch, seen, pidfd,
                                        threads, lock, slot, alive, tid)
        rn = ln if checked is None else rp.descs.lengths
        return memcopy.copy_indexed(rp.addrs, ri, lp.addrs, li, rn, checked, max_bytes, epoch, seen, pidfd, threads,
                                    lock, slot, alive, tid)

    @staticmethod
    def _copied(got: int, op: Op, peer: "_Peer | None", pidfd: int) -> bool:
        """True if ``copy_indexed``'s bytes count; False if it copied nothing
        (STALE, TOO_BIG); ``TransferError`` if they do not count."""
        if got >= 0:
            if peer is None or pidfd >= 0 or peer.alive():
                return True
        elif got == memcopy.STALE or got == memcopy.TOO_BIG:
            return False
        elif got == memcopy.STALE_AFTER:
            raise RemoteRejected(f"peer {peer.name!r} deregistered memory during {op.value}; "
                                 "re-add its metadata and retry")
        cause = PeerDisconnected(f"peer {peer.name!r} (pid {peer.md.pid}) died during {op.value}")
        peer.failed = PeerDisconnected(f"peer {peer.name!r} is gone ({cause}); re-add its metadata to try again")
        raise cause

    def _move_indexed(self, job: _Job) -> bool:
        """A request queued for the one-call path, on the lane's worker.
        False, with the job's rows filled in for the general path, when the
        peer's epoch moved (then its server judges) or its mappings went."""
        lp, li, rp, ri, _, _ = job.indexed
        guards = self._guards(job.peer, rp)
        # on the worker, beside the posting thread: one copy thread fewer than inline
        got = None if guards is None else self._copy_indexed(job.op, job.indexed, _NO_LIMIT, *guards,
                                                              memcopy.BACKGROUND_THREADS)
        if got is not None and self._copied(got, job.op, job.peer, guards[2]):
            return True
        job.lrows, job.rrows, job.rinc = lp.descs.array[li], rp.descs.array[ri], rp.inc
        if guards is not None and rp.mapped is not None:
            job.rmapped, job.rgen = rp.mapped[ri], rp.gen
        return False

    def _inline_ok(self, job: _Job) -> bool:
        """A small copy between host memory that never touches the network."""
        if job.lkind is not MemKind.DRAM or job.rkind is not MemKind.DRAM:
            return False
        p = job.peer  # (call holding its lane)
        return p is None or (p.same_host and not p.epoch.stale and job.rinc == p.inc and
                             (p.cma_ok or job.rgen == p.gen and job.rmapped is not None))

    def check_state(self, handle: XferHandle) -> XferState:
        if self._closed:
            self._check_open()
        return self._xfers[handle].state

    def wait(self, handle: XferHandle, timeout: float) -> XferState:
        """Blocks on the job's completion event: no polling, no core used."""
        self._check_open()
        return self._xfers[handle].wait(seconds(timeout))

    def release(self, handle: XferHandle | PrepHandle) -> None:
        if self._closed:
            self._check_open()
        job = take_handle(self._preps, self._xfers, handle)
        if job is None or job is _DONE:
            return
        job.finish(XferState.err(TransferError("released before completion")))
        with _settle:  # its bytes stop landing now, not when the peer has sent them all
            if job.stream is not None:
                job.stream.abort()
        lane = job.peer.lane if job.peer else self._local
        if job.future is not None and not lane.cancel(job.future):
            wait([job.future], timeout=self.timeout + 1)

    # -- the work, on a peer's (or the local) worker thread ----------------------

    def _run(self, job: _Job) -> None:
        if not job.state.pending:
            return  # cancelled or peer removed before we started
        if job.peer is not None and job.peer.failed is not None:
            # one timeout per dead peer, not one per queued transfer
            job.finish(XferState.err(job.peer.failed))
            return
        try:
            self._move(job)
            if job.notif is not None:
                self._send_notif(job.peer, job.notif)
            job.finish(XferState.DONE)
        except TransferError as e:
            # (not when released meanwhile: release cut its stream, the peer is fine)
            if isinstance(e, (PeerDisconnected, TransferTimeout)) and job.peer is not None and job.state.pending:
                job.peer.failed = PeerDisconnected(f"peer {job.peer.name!r} is gone ({e}); "
                                                   "re-add its metadata to try again")
            job.finish(XferState.err(e))
        except Exception as e:  # whatever went wrong, the job must settle: nothing may stay PROC
            job.finish(XferState.err(TransferError(f"{job.op.value} failed: {type(e).__name__}: {e}")))

    def _move(self, job: _Job) -> None:
        if job.indexed is not None and self._move_indexed(job):
            return
        read = job.op is Op.READ
        local = self._host_rows(job.lrows, job.lkind)
        if not read and job.lkind is not MemKind.DRAM:
            self._mirrors.to_host(job.lrows)
        peer = job.peer
        if peer is None:  # both sides are ours
            remote = self._host_rows(job.rrows, job.rkind)
            if read and job.rkind is not MemKind.DRAM:
                self._mirrors.to_host(job.rrows)
            src, dst = (remote, local) if read else (local, remote)
            memops.memcopy(dst[:, 0], src[:, 0], src[:, 1])
            if not read and job.rkind is not MemKind.DRAM:
                self._mirrors.to_device(job.rrows)
        elif job.rkind is MemKind.DRAM and peer.same_host and self._move_same_host(job, peer, local):
            pass
        else:
            self._move_tcp(job, peer, local)
        if read and job.lkind is not MemKind.DRAM:
            self._mirrors.to_device(job.lrows)

    def _host_rows(self, rows: np.ndarray, kind: MemKind) -> np.ndarray:
        """``(k, 2)`` (address, length) rows in host memory (mirrors for device memory)."""
        if kind is MemKind.DRAM:
            return rows[:, :2]
        out = rows[:, :2].copy()
        out[:, 0] = self._mirrors.translate(rows)
        return out

    def _move_same_host(self, job: _Job, peer: _Peer, local: np.ndarray) -> bool:
        """shm or cma; False if neither is possible (then tcp).  Neither when
        the peer deregistered memory since its metadata: its server then
        judges the request against what it has registered now; nor when the
        rows were checked against another process of the peer's name (a
        prep from before it restarted)."""
        if peer.epoch.stale or job.rinc != peer.inc:
            return False
        read = job.op is Op.READ
        mapped = job.rmapped if job.rgen == peer.gen else None  # its mappings went since: cma
        if mapped is None and not peer.cma_ok:
            return False
        try:
            if mapped is not None:
                src, dst = (mapped, local[:, 0]) if read else (local[:, 0], mapped)
                copied = _held(peer, _unless_stale, peer, memops.memcopy, dst, src, local[:, 1])
            else:
                copied = _held(peer, _unless_stale, peer, memops.cma, not read, peer.md.pid, local, job.rrows[:, :2])
            if not copied:
                return False  # it is deregistering or did: its server judges
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOSYS):
                peer.cma_ok = False  # the kernel forbids it here; tcp from now on
                return False
            if e.errno == errno.ESRCH or not peer.alive():
                raise PeerDisconnected(f"peer {peer.name!r} (pid {peer.md.pid}) died during {job.op.value}") from e
            raise RemoteRejected(f"peer {peer.name!r} memory not accessible: {e}; did it deregister?") from e
        if not peer.alive():  # a dead peer's pages stay mapped; its data no longer counts
            raise PeerDisconnected(f"peer {peer.name!r} (pid {peer.md.pid}) died during {job.op.value}")
        if peer.epoch.stale:  # it deregistered while we copied: the bytes may be of memory it no longer offers
            raise RemoteRejected(f"peer {peer.name!r} deregistered memory during {job.op.value}; "
                                 "re-add its metadata and retry")
        return True

    def _move_tcp(self, job: _Job, peer: _Peer, local: np.ndarray) -> None:
        read = job.op is Op.READ
        # one request per slice within the owner's limits (protocol.MAX_REQUEST_*)
        paired = np.column_stack([local[:, 0], job.rrows[:, 0], job.rrows[:, 1], job.rrows[:, 2]])
        stream = self._stream(peer, job)
        if stream is not None:
            with _settle:
                job.stream = stream
            try:
                if job.state.pending:  # not released before it got here
                    stream.move(job.op.value, job.rkind, [(p[:, [0, 2]], p[:, [1, 2, 3]]) for p in chunks(paired)])
            except (PeerDisconnected, TransferTimeout):
                peer.drop_stream()
                raise
            finally:
                with _settle:
                    job.stream = None
            return
        for part in chunks(paired):
            lrows, rrows = part[:, [0, 2]], part[:, [1, 2, 3]]
            payload = None if read else memops.gather(lrows)
            frames = self._request(peer, Request(id=self._next_id(), sender=self.agent_name, op=job.op.value,
                                                 kind=job.rkind.value, rows=rrows.tobytes()), payload, job)
            if read:
                if len(frames) != 2:
                    raise TransferError(f"peer {peer.name!r} answered a READ without data")
                memops.scatter(lrows, frames[1].buffer)

    def _stream(self, peer: _Peer, job: _Job) -> Stream | None:
        """The peer's data stream, opened through its server on first use;
        None where the server turns streams down (then the bytes go in ZMQ messages)."""
        if peer.stream is not None and (peer.stream.aborted or peer.stream.stale):  # cut by a release, or idle
            peer.drop_stream()
        if peer.stream is None and peer.streams and time.monotonic() >= peer.stream_after:
            try:
                frames = self._request(peer, Request(id=self._next_id(), sender=self.agent_name, op="STREAM"),
                                       None, job)
            except RemoteRejected as e:
                peer.streams = "unknown op" not in str(e)  # an older kvt: ask no more; else maybe next time
                return None
            rep = decode(frames[0].bytes, Reply)
            host = peer.md.endpoint.rsplit(":", 1)[0].split("//", 1)[-1]
            peer.stream = Stream.open(host, rep.port, rep.token, self.timeout, f"peer {peer.name!r}")
            if peer.stream is None:  # its stream slots are taken: ZMQ messages for a while
                peer.stream_after = time.monotonic() + _STREAM_RETRY
        return peer.stream

    def _request(self, peer: _Peer, req: Request, payload, job: _Job) -> list:
        sock = peer.socket()
        sock.send_multipart(peer.seal([encode(req)] + ([payload] if payload is not None else [])), copy=False)
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hint = "" if peer.secret else " (an agent with an auth_key drops connections without it)"
                raise TransferTimeout(f"peer {peer.name!r} did not answer {req.op} within {self.timeout:g}s{hint}")
            if sock.poll(int(min(left, _POLL) * 1000) + 1):
                frames = peer.open(sock.recv_multipart(copy=False))
                if frames is None:
                    continue  # a late answer to a request that already timed out
                rep = decode(frames[0].bytes, Reply)
                if rep.id != req.id:
                    continue  # a late answer to a request that already timed out
                if rep.error:
                    cls = RemoteRejected if rep.code else TransferError
                    raise cls(f"peer {peer.name!r} refused {req.op}: {rep.error}")
                return frames
            if not peer.alive():
                raise PeerDisconnected(f"peer {peer.name!r} (pid {peer.md.pid}) died during {req.op}")
            if not job.state.pending:
                raise TransferError("cancelled")  # released, removed or closed meanwhile

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._check_notif(msg)
        p = self._peers.named(peer)
        try:
            p.lane.submit(self._send_notif, p, bytes(msg))
        except RuntimeError:  # its worker was shut down (remove_remote or close) in between
            raise self._gone(peer) from None

    def _notif_now(self, peer: _Peer, frame: bytes) -> bool:
        """Send a notification, encoded (``_notif_frame``), on the caller's
        thread while it holds ``peer``'s lane (the lane's socket is then its
        own): only on a socket open already, and only if ZMQ queues it at
        once.  False leaves it to the lane's worker, which may connect, or
        wait for room: a post never blocks on a peer.  (Handing it to the
        worker costs a thread wake-up and keeps the lane busy, so a request
        posted right after queues behind the notification instead of copying
        here.)  A same-host peer's goes on the owner's notification socket
        (``kvt_host.notifs``) when it has room."""
        if peer.link is not None:
            return peer.link.send(frame, None)
        sock = peer._sock
        if sock is None:
            return False
        try:  # (a sealed frame not sent only skips a counter value: the receiver wants them growing)
            sock.send_multipart(peer.seal([frame]), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _send_notif(self, peer: _Peer | None, msg: bytes) -> None:
        if peer is None:
            self._inbox.deliver(self.agent_name, msg)
            return
        link = peer.link
        if link is not None:
            try:
                if link.send(self._notif_frame(msg), self.timeout):
                    return
            except TimeoutError:
                raise TransferTimeout(f"peer {peer.name!r} read no notification for {self.timeout:g}s") from None
            # too large for it, or nobody reads that socket: this one and every later one over ZMQ
            # (the owner reads the socket before it takes one in from ZMQ: they stay in order)
            peer.link, peer.notifs_on_zmq = None, True
            link.close()
        sock = peer.socket()
        sock.send_multipart(self._notif_frames(peer, msg))

    def _notif_frame(self, msg: bytes) -> bytes:
        return encode(Request(id=0, sender=self.agent_name, op="NOTIF", msg=msg))

    def _notif_frames(self, peer: _Peer, msg: bytes) -> list:
        return peer.seal([self._notif_frame(msg)])

    def get_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        if self._server.notifs is not None:  # same-host peers' wait in its socket: nobody was woken for them
            self._server.notifs.drain()
        return self._inbox.take()

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        with self._lock:  # add_remote and remove_remote check _closed under it
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        for job in list(self._xfers.values()):  # a copy: posts add to it without our lock
            job.finish(XferState.err(TransferError("backend closed")))
        for p in peers:
            try:
                p.lane.submit(p.close)  # its sockets belong to its lane's thread; after a caller's copy
                there = True
            except RuntimeError:  # at interpreter exit pools take no work: close it here once the lane is idle
                there = False
            p.lane.pool.shutdown(wait=True)  # queued jobs are already ERR and return at once
            if not there:
                p.close()
        self._local.pool.shutdown(wait=True)
        _LIVE.pop(self._server.endpoint, None)
        self._server.close()
        # as deregister does, for everything: peers' copies from or into our memory end before we
        # return (the caller frees it next); the server's threads outlive its sockets by a copy
        self._epoch.bump()
        drained = self._epoch.drain(self.timeout)
        drained = self._server.inflight.close(self.timeout) and drained
        self._epoch.close()
        self._peers.clear()
        self._xfers.clear()
        self._preps.clear()
        self._regions.clear()
        self._mirrors = Mirrors()
        if not drained:
            raise KvtTimeoutError(f"a peer's request still used this agent's memory {self.timeout:g}s after "
                                  "close; do not free it yet (this should not happen: report it)")


if _fastpath is not None:
    _fastpath.setup(Op.READ, Op.WRITE, np.ndarray, memcopy.copy_indexed, SETTLED, memcopy.THREADS)
