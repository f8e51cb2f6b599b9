"""``example``: the smallest complete kvt backend, written to be copied.

Agents of this backend reach each other inside one process only: a
transfer is a ``memmove`` done by the initiator's worker thread, and an
agent's "metadata" names it and lists its registered regions.  That keeps
the plugin-specific part tiny while every verb of the protocol keeps its
contract -- which is what a real backend replaces with calls into its
network library:

========================  ==============================  ==========================================
verb                      here                            in a network backend
========================  ==============================  ==========================================
``register``              remember the rows               pin / register with the NIC, keep the key
``local_metadata``        name, pid, region table         plus address, keys, connection info
``add_remote``            decode, check same process      decode, open a connection lazily
``prep``                  check rows lie in regions       build the native descriptor list
``transfer``              queue a job on a worker thread  post the native READ/WRITE, return at once
``check_state``           the job's state                 poll the native request
``notify``                append to the peer's inbox      send a small message
========================  ==============================  ==========================================

Everything else -- argument checks, index pairing, typed errors -- comes
from ``kvt.Backend``'s helpers and ``kvt.types.Descs``.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
from kvt.backend import Backend, HandleTable, Inbox, PeerTable, RegionTable, take_handle
from kvt.errors import (InvalidArgument, KvtTimeoutError, PeerDisconnected, RemoteRejected, TransferError,
                        UnsupportedOperation, WireError)
from kvt.types import Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle, XferHandle, XferState
from kvt.wire import Message, decode, encode

__all__ = ["ExampleBackend", "ExampleMetadata"]

#: every open agent of this process, by name: how add_remote's names become agents
_AGENTS: "weakref.WeakValueDictionary[str, ExampleBackend]" = weakref.WeakValueDictionary()
_AGENTS_LOCK = threading.Lock()
MAX_NAME = 256  #: characters of a peer's name in its metadata (as the host and nixl backends)


class ExampleMetadata(Message, tag="example_md"):
    """What ``local_metadata`` returns (a kvt wire message, so it carries the
    wire version and decodes with typed errors)."""

    name: str
    pid: int
    regions: bytes  # (n, 3) uint64 rows (address, length, device) of registered DRAM


def _rows(raw: bytes) -> Descs:
    if len(raw) % 24:
        raise WireError(f"region table of {len(raw)} bytes is not a whole number of (address, length, device) rows")
    return Descs(np.frombuffer(raw, np.uint64).reshape(-1, 3))


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy every ``src`` row to its ``dst`` row.  One memmove per row: a
    network backend hands both row arrays to its library in one call."""
    for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), src[:, 1].tolist()):
        ctypes.memmove(d, s, n)


@dataclass
class _Job:
    op: Op
    lrows: np.ndarray
    rrows: np.ndarray
    peer: str | None  # None: a local transfer
    notif: bytes | None
    state: XferState = XferState.PROC
    lock: threading.Lock = field(default_factory=threading.Lock)
    future: Any = None

    def finish(self, state: XferState) -> None:
        with self.lock:  # the first outcome wins (completion, release, close)
            if self.state.pending:
                self.state = state


class ExampleBackend(Backend):
    """In-process agents, host memory only.  Options: ``timeout`` (seconds
    ``release`` waits for a running job)."""

    capabilities = Capabilities(mem_kinds=frozenset({MemKind.DRAM}), ops=frozenset(Op), notifications=True,
                                local=True, remote=False, cross_host=False, max_notif_bytes=64 * 1024,
                                cross_host_options={}, owner_check="server")

    option_names: frozenset[str] = frozenset()  # timeout only

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        super().__init__(agent_name, options)
        self._regions = RegionTable()                       # ours, read by peers' workers too
        self._cv = threading.Condition()                    # peers' workers check _regions under it
        self._copying = 0                                   # their copies from or into our memory, now
        self._peers = PeerTable()                           # peer -> its regions, as its metadata said
        self._preps = HandleTable("prepped descriptor list")  # handle -> (peer or None, Descs)
        self._xfers = HandleTable("transfer")
        self._inbox = Inbox()
        # one worker: jobs run in the order posted, and never on the caller's thread
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"kvt-example:{agent_name}")
        with _AGENTS_LOCK:
            if agent_name in _AGENTS:
                self._worker.shutdown()
                raise InvalidArgument(f"an example agent named {agent_name!r} already exists in this process")
            _AGENTS[agent_name] = self

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Descs) -> RegHandle:
        self._check_open()
        descs = Descs.coerce(mem)
        self._check_kind(descs.kind)
        h = self._next_id()
        self._regions.add(h, descs)
        return RegHandle(h)

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        with self._cv:
            self._regions.remove(handle)
            # the caller may free the memory next: copies that passed their check finish first
            # (all of them, which is simpler than tracking the rows of each; they run at memory speed)
            if not self._cv.wait_for(lambda: not self._copying, self.timeout):
                raise KvtTimeoutError(f"a copy still used {self.agent_name!r}'s memory after {self.timeout:g}s; "
                                      "do not free it yet")

    # -- peers ----------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        return encode(ExampleMetadata(name=self.agent_name, pid=os.getpid(), regions=self._regions.of(MemKind.DRAM).array.tobytes()))

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        md = decode(metadata, ExampleMetadata)  # WireError / VersionMismatch on bad bytes
        if not 0 < len(md.name) <= MAX_NAME:  # "" would be a peer no error message can name
            raise WireError(f"peer name must be 1 to {MAX_NAME} characters, got {len(md.name)}")
        if md.pid != os.getpid():
            raise UnsupportedOperation(f"agent {md.name!r} lives in process {md.pid}; the example backend reaches "
                                       "agents of its own process only (it declares remote=False)")
        if md.name == self.agent_name:
            raise InvalidArgument("that is this agent's own metadata; local transfers use prep(None, ...)")
        self._peers[md.name] = _rows(md.regions)
        return md.name

    def remove_remote(self, peer: str) -> None:
        self._check_open()
        self._peers.remove(peer)
        for job in list(self._xfers.values()):
            if job.peer == peer:
                job.finish(XferState.err(PeerDisconnected(f"peer {peer!r} was removed")))

    # -- transfers ------------------------------------------------------------

    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        descs = self._prep_descs(descs)
        self._within(descs, self._regions.of(descs.kind) if peer is None else self._peers.named(peer), peer)
        h = self._next_id()
        self._preps[h] = (peer, descs)
        return PrepHandle(h)

    def transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle,
                 remote_idx: Any, notif: bytes | None = None) -> XferHandle:
        self._check_open()
        op = self._check_op(op, notif)
        (lpeer, ldescs), (rpeer, rdescs) = self._preps[local_prep], self._preps[remote_prep]
        if lpeer is not None:
            raise InvalidArgument("local_prep must describe this agent's memory: make it with prep(None, ...)")
        if rpeer is not None:
            self._peers[rpeer]  # still known?
        lrows, rrows = self._pair(ldescs, local_idx, rdescs, remote_idx)
        job = _Job(op, lrows, rrows, rpeer, None if notif is None else bytes(notif))
        h = self._next_id()
        self._xfers[h] = job
        job.future = self._worker.submit(self._run, job)
        return XferHandle(h)

    def _run(self, job: _Job) -> None:
        """On the worker thread: move the bytes, then deliver the notification."""
        if not job.state.pending:
            return  # released or removed before it started
        target = self if job.peer is None else _AGENTS.get(job.peer)
        if target is None or target._closed:
            return job.finish(XferState.err(PeerDisconnected(f"peer {job.peer!r} is gone")))
        # each side copies only memory its owner has registered now (we may have deregistered ours
        # since the prep, the target its own since its metadata), and each owner's deregister waits
        # for the copies that passed its check
        ours = job.lrows if job.peer is not None else np.concatenate([job.lrows, job.rrows])
        if not self._claim(ours):
            return job.finish(XferState.err(TransferError(
                f"{job.op.value}: its memory was deregistered while it was under way; register it again and retry")))
        try:
            if job.peer is not None and not target._claim(job.rrows):
                return job.finish(XferState.err(RemoteRejected(
                    f"{job.op.value} touches memory {target.agent_name!r} no longer has registered")))
            try:
                src, dst = (job.rrows, job.lrows) if job.op is Op.READ else (job.lrows, job.rrows)
                _copy(dst, src)
            finally:
                if job.peer is not None:
                    target._unclaim()
        finally:
            self._unclaim()
        if job.notif is not None:
            target._inbox.deliver(self.agent_name, job.notif)
        job.finish(XferState.DONE)

    def _claim(self, rows: np.ndarray) -> bool:
        """Count a copy of ``rows`` of our memory in (``deregister`` waits for
        it), if every row lies in memory registered now."""
        with self._cv:
            if (Descs(rows).locate(self._regions.of(MemKind.DRAM)) < 0).any():
                return False
            self._copying += 1
            return True

    def _unclaim(self) -> None:
        with self._cv:
            self._copying -= 1
            self._cv.notify_all()

    def check_state(self, handle: XferHandle) -> XferState:
        self._check_open()
        return self._xfers[handle].state

    def release(self, handle: XferHandle | PrepHandle) -> None:
        self._check_open()
        job = take_handle(self._preps, self._xfers, handle)
        if job is None:
            return
        job.finish(XferState.err(TransferError("released before completion")))
        if not job.future.cancel():
            wait([job.future], timeout=self.timeout)  # a running memmove cannot be interrupted

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._check_notif(msg)
        self._peers.named(peer)  # known? (any name a caller passes)
        target = _AGENTS.get(peer)
        if target is None or target._closed:
            raise PeerDisconnected(f"peer {peer!r} is gone")
        target._inbox.deliver(self.agent_name, bytes(msg))

    def get_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        return self._inbox.take()

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # as deregister for every registration: no new copy passes a peer's check once the regions
        # are gone, and the caller may free the memory once close returns, so wait for the copies
        # that passed it (a peer's worker holds _copying across its memmove)
        with self._cv:
            self._regions.clear()
            drained = self._cv.wait_for(lambda: not self._copying, self.timeout)
        for job in list(self._xfers.values()):
            job.finish(XferState.err(TransferError("backend closed")))
        self._worker.shutdown(wait=True)  # queued jobs see ERR and return at once
        with _AGENTS_LOCK:
            if _AGENTS.get(self.agent_name) is self:
                del _AGENTS[self.agent_name]
        self._xfers.clear()
        self._preps.clear()
        self._peers.clear()
        if not drained:
            raise KvtTimeoutError(f"a copy still used {self.agent_name!r}'s memory after {self.timeout:g}s; "
                                  "do not free it yet")
