"""A test double over a backend's transfer verbs, for reads that lose their
peer: every transfer posted gets a handle of the double's own, so what its
state says is the test's to decide, whatever the backend answered (a handle,
or ``SETTLED`` for a copy done before ``transfer`` returned, which the
agent would never ask about)."""

from __future__ import annotations

import itertools

from kvt.errors import PeerDisconnected
from kvt.types import XferState

VERBS = ("transfer", "check_state", "wait", "release")


class LossDouble:
    """Handles in ``hold`` stay pending, in ``fail`` end with their peer lost;
    a transfer posted while ``fail_new`` (or while ``fail_next`` counts down)
    fails, one posted while ``hold_new`` is held; the rest say what the
    backend says.  Installed with ``monkeypatch`` on ``backend``."""

    def __init__(self, backend, monkeypatch):
        self.real = {verb: getattr(backend, verb) for verb in VERBS}
        self.posted: dict[int, object] = {}  # our handle -> the backend's
        self._ids = itertools.count(-1, -1)  # negative: no backend's handle, never SETTLED
        self.hold: set[int] = set()
        self.fail: set[int] = set()
        self.hold_new, self.fail_new, self.fail_next = True, False, 0
        for verb in VERBS:
            monkeypatch.setattr(backend, verb, getattr(self, verb))

    def transfer(self, *args, **kwargs):
        real = self.real["transfer"](*args, **kwargs)
        h = next(self._ids)
        self.posted[h] = real
        if self.fail_new or self.fail_next:
            self.fail_next = max(0, self.fail_next - 1)
            self.fail.add(h)
        elif self.hold_new:
            self.hold.add(h)
        return h

    def check_state(self, h):
        if h not in self.posted:
            return self.real["check_state"](h)
        if h in self.fail:
            return XferState.err(PeerDisconnected("test double: peer lost"))
        if h in self.hold:
            return XferState.PROC
        return self.real["check_state"](self.posted[h])

    def wait(self, h, timeout):
        return self.check_state(h) if h in self.posted else self.real["wait"](h, timeout)

    def release(self, h):
        if h in self.posted:
            self.hold.discard(h)
            self.fail.discard(h)
            h = self.posted.pop(h)
        self.real["release"](h)

    def lose(self, h):
        self.hold.discard(h)
        self.fail.add(h)
