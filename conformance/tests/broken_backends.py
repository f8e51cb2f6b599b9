"""Deliberately broken test doubles of the example backend.  Each breaks
one contract of the protocol; tests/test_broken_backends.py runs the whole
conformance suite on each and checks that the tests meant to catch that
breakage fail (and that the unbroken example passes them)."""

from __future__ import annotations

import time

import msgspec
from kvt.backend import Inbox
from kvt.errors import RemoteRejected
from kvt.types import Descs, MemKind, Op, XferState
from kvt_example.backend import _AGENTS, ExampleBackend, _copy

#: seconds the early-DONE double lets the bytes lag behind its DONE
LAG = 0.02


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
        target = self if job.peer is None else _AGENTS[job.peer]
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
        target = self if job.peer is None else _AGENTS[job.peer]
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


#: the unbroken backend first: the control every variant is compared with
VARIANTS = (ExampleBackend, BrokenEarlyDone, BrokenEarlyDoneRead, BrokenEarlyDoneWrite, BrokenNoOwnerCheck,
            BrokenNoBoundsCheck, BrokenEarlyNotif, BrokenCrossHost, BrokenDropsNotifs)
