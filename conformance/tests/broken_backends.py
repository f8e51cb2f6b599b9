"""Deliberately broken test doubles of the example backend.  Each breaks
one contract of the protocol; tests/test_broken_backends.py runs the whole
conformance suite on each and checks that the tests meant to catch that
breakage fail (and that the unbroken example passes them)."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
from kvt.backend import HandleTable, Inbox, take_handle
from kvt.errors import (InvalidArgument, InvalidDescriptor, PeerDisconnected, RemoteRejected, TransferError, WireError,
                        UnsupportedOperation)
from kvt.types import SETTLED, Descs, MemKind, Op, XferState, as_index
from kvt.wire import decode
from kvt_example.backend import _AGENTS, _AGENTS_LOCK, ExampleBackend, ExampleMetadata, _copy, _Job, _rows

#: seconds the early-DONE double lets the bytes lag behind its DONE
LAG = 0.02


def _target(backend, job):
    """The agent whose memory a job's remote rows are, or None once the job
    ended ERR because there is none (as the example's own ``_run`` does)."""
    target = backend if job.peer is None else _AGENTS.get(job.peer)
    if target is None or target._closed:
        job.finish(XferState.err(PeerDisconnected(f"peer {job.peer!r} is gone")))
        return None
    return target


class BrokenEarlyDone(ExampleBackend):
    """Test double: reports DONE as soon as a transfer exists (as if DONE
    came when the request was sent, not when the reply arrived); the bytes
    land ``LAG`` later."""

    early = frozenset(Op)

    def check_state(self, handle):
        state = super().check_state(handle)  # unknown handles still raise
        return XferState.DONE if self._xfers[handle].op in self.early else state

    def _run(self, job):
        if job.op in self.early:
            time.sleep(LAG)
        super()._run(job)


class BrokenEarlyDoneRead(BrokenEarlyDone):
    """Test double: early DONE for READ only."""

    early = frozenset({Op.READ})


class BrokenEarlyDoneWrite(BrokenEarlyDone):
    """Test double: early DONE for WRITE only (the initiator never waits for the target's acknowledgement)."""

    early = frozenset({Op.WRITE})


class BrokenNoOwnerCheck(ExampleBackend):
    """Test double: the owner (target) serves any request its peer preps,
    trusting the initiator's copy of its metadata: memory deregistered since
    still moves."""

    def _run(self, job):
        if not job.state.pending:
            return
        target = _target(self, job)
        if target is None:
            return
        src, dst = (job.rrows, job.lrows) if job.op is Op.READ else (job.lrows, job.rrows)
        _copy(dst, src)
        if job.notif is not None:
            target._inbox.deliver(self.agent_name, job.notif)
        job.finish(XferState.DONE)


class BrokenNoBoundsCheck(BrokenNoOwnerCheck):
    """Test double: preps any rows and moves bytes wherever they point,
    registered or not (a read outside registered memory goes through)."""

    def prep(self, peer, descs):
        descs = self._prep_descs(descs)
        if peer is not None:
            self._peers[peer]  # known? (the one check kept)
        h = self._next_id()
        self._preps[h] = (peer, descs)
        return h


class BrokenEarlyNotif(ExampleBackend):
    """Test double: delivers a transfer's notification, then moves its bytes
    (which land ``LAG`` later, as data behind its notification on a wire)."""

    def _run(self, job):
        if not job.state.pending:
            return
        target = _target(self, job)
        if target is None:
            return
        if (Descs(job.rrows).locate(target._regions.of(MemKind.DRAM)) < 0).any():
            return job.finish(XferState.err(RemoteRejected("not registered")))
        if job.notif is not None:
            target._inbox.deliver(self.agent_name, job.notif)
        time.sleep(LAG)
        src, dst = (job.rrows, job.lrows) if job.op is Op.READ else (job.lrows, job.rrows)
        _copy(dst, src)
        job.finish(XferState.DONE)


class BrokenCrossHost(ExampleBackend):
    """Test double: declares cross_host (what a forgotten field meant when
    Capabilities() declared everything) though its agents reach only agents
    of their own process."""

    capabilities = msgspec.structs.replace(ExampleBackend.capabilities, cross_host=True)


class _BlackHole(Inbox):
    def deliver(self, sender, msg):
        pass


class BrokenDropsNotifs(ExampleBackend):
    """Test double: accepts notifications (standalone and attached) and never delivers them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inbox = _BlackHole()


class BrokenDeregisterNoDrain(ExampleBackend):
    """Test double: ``deregister`` returns at once, while a peer's transfer
    may still be copying into or out of that memory."""

    def deregister(self, handle):
        self._check_open()
        self._regions.remove(handle)


class BrokenOwnMemoryUnchecked(ExampleBackend):
    """Test double: a copy checks only the target's registrations, not ours
    (as the example once did): a transfer queued before we deregistered its
    memory, or posted afterwards with a prep of it, still copies it."""

    def _claim(self, rows):
        with self._cv:
            self._copying += 1
            return True


class BrokenSettledEarly(ExampleBackend):
    """Test double: answers ``SETTLED`` as soon as a transfer is queued (as
    if posted meant done); its bytes land ``LAG`` later."""

    def __init__(self, agent_name, options=None):
        super().__init__(agent_name, options)
        done = _Job(Op.READ, None, None, None, None)
        done.state = XferState.DONE
        self._xfers = HandleTable("transfer", settled=done)

    def transfer(self, *args, **kwargs):
        super().transfer(*args, **kwargs)  # its handle stays in the table, never given out
        return SETTLED

    def _run(self, job):
        time.sleep(LAG)
        super()._run(job)


class BrokenReleaseReturnsEarly(ExampleBackend):
    """Test double: ``release`` of a running transfer returns without waiting
    for it, so its bytes go on landing."""

    def release(self, handle):
        self._check_open()
        job = take_handle(self._preps, self._xfers, handle)
        if job is not None:
            job.finish(XferState.err(TransferError("released before completion")))
            job.future.cancel()  # only a job not started yet stops


#: rows per request of the doubles that cut transfers into requests (kvt_host's limit)
REQUEST_ROWS = 1 << 16


class BrokenNotifAfterFirstRequest(ExampleBackend):
    """Test double: cuts a transfer into requests of ``REQUEST_ROWS`` rows and
    delivers the notification with the first; the rest land ``LAG`` later.
    Transfers of one request are correct."""

    def _run(self, job):
        if not job.state.pending:
            return
        target = _target(self, job)
        if target is None:
            return
        if (Descs(job.rrows).locate(target._regions.of(MemKind.DRAM)) < 0).any():
            return job.finish(XferState.err(RemoteRejected("not registered")))
        src, dst = (job.rrows, job.lrows) if job.op is Op.READ else (job.lrows, job.rrows)
        for start in range(0, len(src), REQUEST_ROWS):
            _copy(dst[start:start + REQUEST_ROWS], src[start:start + REQUEST_ROWS])
            if start == 0 and job.notif is not None:
                target._inbox.deliver(self.agent_name, job.notif)
            if start + REQUEST_ROWS < len(src):
                time.sleep(LAG)
        job.finish(XferState.DONE)


class BrokenRangeArithmetic(ExampleBackend):
    """Test double: ``prep`` checks rows against registered regions with
    naive uint64 arithmetic: an inclusive end (a row may end one byte past a
    region) and ``address + length`` that wraps past 2**64."""

    def prep(self, peer, descs):
        descs = self._prep_descs(descs)
        regions = self._regions.of(descs.kind) if peer is None else self._peers[peer]
        with np.errstate(over="ignore"):
            last = descs.addrs + descs.lengths - np.uint64(1)
            ok = np.zeros(len(descs), bool)
            for start, length, _ in regions.array:
                ok |= (descs.addrs >= start) & (last <= start + length)
        if not ok.all():
            raise InvalidDescriptor("descriptors outside registered memory")
        h = self._next_id()
        self._preps[h] = (peer, descs)
        return h


class BrokenOwnerChecksStartsOnly(ExampleBackend):
    """Test double: the owner checks only that each row *starts* in memory it
    has registered now, not that it ends there."""

    def _run(self, job):
        if not job.state.pending:
            return
        target = _target(self, job)
        if target is None:
            return
        starts = job.rrows.copy()
        starts[:, 1] = 1
        if (Descs(starts).locate(target._regions.of(MemKind.DRAM)) < 0).any():
            return job.finish(XferState.err(RemoteRejected("not registered")))
        src, dst = (job.rrows, job.lrows) if job.op is Op.READ else (job.lrows, job.rrows)
        _copy(dst, src)
        if job.notif is not None:
            target._inbox.deliver(self.agent_name, job.notif)
        job.finish(XferState.DONE)


class BrokenPeerOnlyNoPairCheck(ExampleBackend):
    """Test double: declares no local transfers (so the suite's local-only
    argument tests skip), and pairs a peer transfer's rows without comparing
    counts or lengths (extra rows dropped, the local row's length moved)."""

    capabilities = msgspec.structs.replace(ExampleBackend.capabilities, local=False)

    def transfer(self, op, local_prep, local_idx, remote_prep, remote_idx, notif=None):
        self._check_open()
        op = self._check_op(op, notif)
        (lpeer, ldescs), (rpeer, rdescs) = self._preps[local_prep], self._preps[remote_prep]
        if lpeer is not None:
            raise InvalidArgument("local_prep must describe this agent's memory")
        if rpeer is None:
            raise UnsupportedOperation("local transfers are not declared")
        self._peers[rpeer]
        li, ri = as_index(local_idx, len(ldescs), "local_idx"), as_index(remote_idx, len(rdescs), "remote_idx")
        n = min(li.size, ri.size)
        lrows, rrows = ldescs.array[li[:n]], rdescs.array[ri[:n]].copy()
        rrows[:, 1] = lrows[:, 1]
        job = _Job(op, lrows, rrows, rpeer, None if notif is None else bytes(notif))
        h = self._next_id()
        self._xfers[h] = job
        job.future = self._worker.submit(self._run, job)
        return h


class BrokenMetadataLeaksValueError(ExampleBackend):
    """Test double: ``add_remote`` reads the peer's region table without
    checking its size: numpy's ``ValueError`` escapes instead of ``WireError``."""

    def add_remote(self, metadata):
        self._check_open()
        md = decode(metadata, ExampleMetadata)
        if md.pid != os.getpid():
            raise UnsupportedOperation("agents of this process only")
        self._peers[md.name] = Descs(np.frombuffer(md.regions, np.uint64).reshape(-1, 3))
        return md.name


class BrokenEmptyPeerName(ExampleBackend):
    """Test double: ``add_remote`` checks everything but the peer's name, so
    metadata naming its agent "" loads a peer called ""."""

    def add_remote(self, metadata):
        self._check_open()
        md = decode(metadata, ExampleMetadata)
        if md.pid != os.getpid():
            raise UnsupportedOperation("agents of this process only")
        if md.name == self.agent_name:
            raise InvalidArgument("that is this agent's own metadata")
        self._peers[md.name] = _rows(md.regions)
        return md.name


class BrokenLongPeerName(BrokenEmptyPeerName):
    """Test double: ``add_remote`` refuses an empty peer name but not one of
    any length."""

    def add_remote(self, metadata):
        if not decode(metadata, ExampleMetadata).name:
            raise WireError("empty peer name")
        return super().add_remote(metadata)


class BrokenNotifOnRefusal(ExampleBackend):
    """Test double: when the owner refuses a transfer (memory it no longer
    has registered), the transfer's notification still goes out."""

    def _run(self, job):
        target = _target(self, job) if job.state.pending else None
        if target is not None and job.notif is not None and \
                (Descs(job.rrows).locate(target._regions.of(MemKind.DRAM)) < 0).any():
            target._inbox.deliver(self.agent_name, job.notif)
        super()._run(job)


class BrokenReaddDropsPeer(ExampleBackend):
    """Test double: ``add_remote`` of a peer already loaded, even with its
    metadata unchanged, reconnects it: what was in flight to it ends ERR (as
    the ucx backend once dropped the endpoint of a live peer re-added)."""

    def add_remote(self, metadata):
        name = super().add_remote(metadata)
        for job in list(self._xfers.values()):
            if job.peer == name:
                job.finish(XferState.err(PeerDisconnected(f"peer {name!r} was replaced by new metadata")))
        return name


class BrokenAcceptsAnyOption(ExampleBackend):
    """Test double: declares its options but takes any key (a misspelt one is silently the default)."""

    @classmethod
    def check_options(cls, options):
        pass


class BrokenUnhashablePeerName(ExampleBackend):
    """Test double: looks a caller's peer name up with ``[]`` (the example
    before it used ``PeerTable.named``): an unhashable name is a TypeError."""

    def prep(self, peer, descs):
        if peer is not None:
            self._peers[peer]
        return super().prep(peer, descs)


class BrokenCloseNoDrain(ExampleBackend):
    """Test double: ``close`` does not wait for peers' copies into or out of
    its memory, as ``deregister`` does (the example's own close, before it
    was fixed): the caller frees the memory while a peer still copies it."""

    def close(self):
        if self._closed:
            return
        self._closed = True
        for job in list(self._xfers.values()):
            job.finish(XferState.err(TransferError("backend closed")))
        self._worker.shutdown(wait=True)
        with _AGENTS_LOCK:
            if _AGENTS.get(self.agent_name) is self:
                del _AGENTS[self.agent_name]
        self._xfers.clear()
        self._preps.clear()
        self._regions.clear()
        self._peers.clear()


#: bytes of a row the truncating double moves; the rest is dropped (a staging buffer whose tail is forgotten)
STAGE = 4 << 20


class BrokenTruncatesLongRows(ExampleBackend):
    """Test double: copies each row through a ``STAGE``-byte staging buffer
    and silently drops the rest of a longer row; the transfer ends DONE."""

    def _run(self, job):
        job.lrows, job.rrows = job.lrows.copy(), job.rrows.copy()
        job.lrows[:, 1] = np.minimum(job.lrows[:, 1], STAGE)
        job.rrows[:, 1] = np.minimum(job.rrows[:, 1], STAGE)
        super()._run(job)


class BrokenTransferAfterRemove(ExampleBackend):
    """Test double: ``transfer`` does not check that a remote prep's peer is
    still loaded: a prep made before ``remove_remote`` still moves bytes."""

    def transfer(self, op, local_prep, local_idx, remote_prep, remote_idx, notif=None):
        self._check_open()
        op = self._check_op(op, notif)
        (lpeer, ldescs), (rpeer, rdescs) = self._preps[local_prep], self._preps[remote_prep]
        if lpeer is not None:
            raise InvalidArgument("local_prep must describe this agent's memory")
        lrows, rrows = self._pair(ldescs, local_idx, rdescs, remote_idx)
        job = _Job(op, lrows, rrows, rpeer, None if notif is None else bytes(notif))
        h = self._next_id()
        self._xfers[h] = job
        job.future = self._worker.submit(self._run, job)
        return h


class BrokenRemoveKeepsInFlight(ExampleBackend):
    """Test double: ``remove_remote`` forgets the peer but lets its
    transfers in flight run on to DONE."""

    def remove_remote(self, peer):
        self._check_open()
        self._peers.remove(peer)


class BrokenDupAttachedNotif(ExampleBackend):
    """Test double: a transfer with a peer delivers its notification twice
    (a retransmit nobody de-duplicates); local transfers are correct."""

    def _run(self, job):
        super()._run(job)
        if job.peer is not None and job.notif is not None and job.state.done:
            target = _AGENTS.get(job.peer)
            if target is not None:
                target._inbox.deliver(self.agent_name, job.notif)


class BrokenNotifToLastPeer(ExampleBackend):
    """Test double: a transfer's notification goes to the peer loaded last
    with ``add_remote``, not to the transfer's target."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last_peer = None

    def add_remote(self, metadata):
        self._last_peer = super().add_remote(metadata)
        return self._last_peer

    def _run(self, job):
        notif, job.notif = job.notif, None
        super()._run(job)
        if notif is not None and job.state.done:
            to = self if job.peer is None else _AGENTS.get(self._last_peer)
            if to is not None:
                to._inbox.deliver(self.agent_name, notif)


class BrokenNotifyNoSizeCheck(ExampleBackend):
    """Test double: ``notify`` sends a message longer than ``max_notif_bytes``."""

    def notify(self, peer, msg):
        self._check_open()
        if not isinstance(msg, (bytes, bytearray, memoryview)):
            raise InvalidArgument("notification must be bytes")
        self._peers[peer]
        target = _AGENTS.get(peer)
        if target is None or target._closed:
            raise PeerDisconnected(f"peer {peer!r} is gone")
        target._inbox.deliver(self.agent_name, bytes(msg))


class BrokenNotifyNoTypeCheck(ExampleBackend):
    """Test double: ``notify`` checks the size of a message but not that it
    is bytes: a ``TypeError`` escapes for text or None."""

    def notify(self, peer, msg):
        self._check_open()
        if len(msg) > self.capabilities.max_notif_bytes:
            raise InvalidArgument("notification too long")
        self._peers[peer]
        target = _AGENTS.get(peer)
        if target is None or target._closed:
            raise PeerDisconnected(f"peer {peer!r} is gone")
        target._inbox.deliver(self.agent_name, bytes(msg))


class BrokenReleasePrepEndsTransfers(ExampleBackend):
    """Test double: releasing a prep handle ends the transfers posted from
    it in ERR (as if the native list they still use were freed)."""

    def transfer(self, op, local_prep, local_idx, remote_prep, remote_idx, notif=None):
        h = super().transfer(op, local_prep, local_idx, remote_prep, remote_idx, notif)
        self._xfers[h].preps = (local_prep, remote_prep)
        return h

    def release(self, handle):
        if handle in self._preps:
            for job in list(self._xfers.values()):
                if handle in getattr(job, "preps", ()):
                    job.finish(XferState.err(TransferError("its prep was released")))
        super().release(handle)


class BrokenLeaksWorkerOnClose(ExampleBackend):
    """Test double: ``close`` never stops its worker thread (a native handle
    registry keeps it): one thread leaked per closed backend."""

    _registry: list = []

    def close(self):
        if self._closed:
            return
        self._registry.append(self._worker)  # never shut down
        self._worker = _NoShutdown()
        super().close()


class _NoShutdown:
    def shutdown(self, wait=True):
        pass


try:
    from kvt_host.backend import HostBackend
except ImportError:  # the host plugin is not installed: its double is left out
    HostBackend = None

if HostBackend is not None:
    class BrokenHostBlockingCheckState(HostBackend):
        """Test double of the host backend (a peer in another process, which
        the example's doubles cannot have): ``check_state`` waits for the
        transfer to settle, up to ``timeout``, instead of polling."""

        def check_state(self, handle):
            self.wait(handle, self.timeout)
            return super().check_state(handle)

    class BrokenHostFailsOnePerTimeout(HostBackend):
        """Test double of the host backend: a peer that stopped answering is
        never marked failed, so each transfer queued to it waits out a
        timeout of its own (four queued: four timeouts) and so does every
        later one, instead of failing at once."""

        def _run(self, job):
            if job.peer is not None:
                job.peer.failed = None
            super()._run(job)

    class BrokenHostDeregisterNoDrain(HostBackend):
        """Test double of the host backend, a fast one (its copies are native
        memcpy, gone in a few ms, where the example's run in Python):
        ``deregister`` withdraws the memory and returns without waiting for
        the copies of it in flight."""

        def deregister(self, handle):
            self._check_open()
            with self._lock:
                self._regions.remove(handle)
                self._epoch.bump()
                self._mirrors.remove(handle)


#: variants run with the suites' own timeouts, not the short ones the example's doubles get
OWN_TIMEOUTS = {"BrokenHostBlockingCheckState", "BrokenHostFailsOnePerTimeout", "BrokenHostDeregisterNoDrain"}

#: the suites a variant runs, where not every suite: each double made for one contract runs the suites
#: that test it and those it must still pass (running all of them again mostly re-tests the example)
SUITES = {
    "BrokenDeregisterNoDrain": ("RegistrationTests", "OwnerCheckTests", "CompletionTests"),
    "BrokenReleaseReturnsEarly": ("TransferTests", "CompletionTests", "EngineScenarioTests"),
    "BrokenSettledEarly": ("RegistrationTests", "CompletionTests"),
    "BrokenOwnMemoryUnchecked": ("RegistrationTests", "CompletionTests"),
    "BrokenNotifAfterFirstRequest": ("DescriptorTests", "TransferTests", "NotificationTests"),
    "BrokenRangeArithmetic": ("RegistrationTests", "TransferTests", "ErrorTests"),
    "BrokenOwnerChecksStartsOnly": ("TransferTests", "OwnerCheckTests"),
    "BrokenPeerOnlyNoPairCheck": ("TransferTests", "CompletionTests", "ErrorTests"),
    "BrokenMetadataLeaksValueError": ("TransferTests", "MetadataTests"),
    "BrokenNotifOnRefusal": ("NotificationTests", "OwnerCheckTests"),
    "BrokenEmptyPeerName": ("TransferTests", "MetadataTests"),
    "BrokenLongPeerName": ("MetadataTests",),
    "BrokenReaddDropsPeer": ("TransferTests", "MetadataTests"),
    "BrokenAcceptsAnyOption": ("ErrorTests",),
    "BrokenUnhashablePeerName": ("ErrorTests",),
    "BrokenCloseNoDrain": ("RegistrationTests", "OwnerCheckTests"),
    "BrokenTruncatesLongRows": ("TransferTests",),
    "BrokenTransferAfterRemove": ("MetadataTests",),
    "BrokenRemoveKeepsInFlight": ("MetadataTests", "FaultTests"),
    "BrokenDupAttachedNotif": ("NotificationTests",),
    "BrokenNotifToLastPeer": ("NotificationTests",),
    "BrokenNotifyNoSizeCheck": ("NotificationTests", "ErrorTests"),
    "BrokenNotifyNoTypeCheck": ("NotificationTests", "ErrorTests"),
    "BrokenReleasePrepEndsTransfers": ("DescriptorTests", "CompletionTests"),
    "BrokenLeaksWorkerOnClose": ("ConcurrencyTests", "ErrorTests"),
    "BrokenHostBlockingCheckState": ("FaultTests",),
    "BrokenHostFailsOnePerTimeout": ("FaultTests",),
    "BrokenHostDeregisterNoDrain": ("RegistrationTests", "OwnerCheckTests"),
}

#: the unbroken backend first: the control every variant is compared with
VARIANTS = (ExampleBackend, BrokenEarlyDone, BrokenEarlyDoneRead, BrokenEarlyDoneWrite, BrokenNoOwnerCheck,
            BrokenNoBoundsCheck, BrokenEarlyNotif, BrokenCrossHost, BrokenDropsNotifs, BrokenDeregisterNoDrain,
            BrokenReleaseReturnsEarly, BrokenNotifAfterFirstRequest, BrokenRangeArithmetic,
            BrokenOwnerChecksStartsOnly, BrokenPeerOnlyNoPairCheck, BrokenMetadataLeaksValueError,
            BrokenNotifOnRefusal, BrokenEmptyPeerName, BrokenLongPeerName, BrokenReaddDropsPeer, BrokenAcceptsAnyOption,
            BrokenCloseNoDrain, BrokenTruncatesLongRows, BrokenTransferAfterRemove, BrokenRemoveKeepsInFlight,
            BrokenDupAttachedNotif, BrokenNotifToLastPeer, BrokenNotifyNoSizeCheck, BrokenNotifyNoTypeCheck,
            BrokenReleasePrepEndsTransfers, BrokenLeaksWorkerOnClose, BrokenUnhashablePeerName, BrokenSettledEarly,
            BrokenOwnMemoryUnchecked)
if HostBackend is not None:
    VARIANTS += (BrokenHostBlockingCheckState, BrokenHostFailsOnePerTimeout, BrokenHostDeregisterNoDrain)
