"""Deliberately broken test doubles of the example backend.  Each breaks
one contract of the protocol; tests/test_broken_backends.py runs the whole
conformance suite on each and checks that the tests meant to catch that
breakage fail (and that the unbroken example passes them)."""

from __future__ import annotations

import time

from kvt.backend import Inbox
from kvt.types import Descs, Op, XferState
from kvt_example.backend import _AGENTS, ExampleBackend, _copy

#: seconds the early-DONE double lets the bytes lag behind its DONE
LAG = 0.02


class BrokenEarlyDone(ExampleBackend):
    """Test double: reports DONE as soon as a transfer exists; the bytes land ``LAG`` later."""

    def check_state(self, handle):
        super().check_state(handle)  # unknown handles still raise
        return XferState.DONE

    def _run(self, job):
        time.sleep(LAG)
        super()._run(job)


class BrokenNoBoundsCheck(ExampleBackend):
    """Test double: preps any rows and moves bytes wherever they point,
    registered or not (a read outside registered memory goes through)."""

    def prep(self, peer, descs):
        self._check_open()
        descs = Descs.coerce(descs)
        self._check_kind(descs.kind)
        if peer is not None:
            self._peer_regions(peer)
        h = self._next_id()
        self._preps[h] = (peer, descs)
        return h

    def _run(self, job):
        src, dst = (job.rrows, job.lrows) if job.op is Op.READ else (job.lrows, job.rrows)
        _copy(dst, src)
        if job.notif is not None:
            (self if job.peer is None else _AGENTS[job.peer])._inbox.deliver(self.agent_name, job.notif)
        job.finish(XferState.DONE)


class _BlackHole(Inbox):
    def deliver(self, sender, msg):
        pass


class BrokenDropsNotifs(ExampleBackend):
    """Test double: accepts notifications (standalone and attached) and never delivers them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inbox = _BlackHole()


#: the unbroken backend first: the control every variant is compared with
VARIANTS = (ExampleBackend, BrokenEarlyDone, BrokenNoBoundsCheck, BrokenDropsNotifs)
