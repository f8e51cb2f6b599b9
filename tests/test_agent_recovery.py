"""How an Agent looks for a lost peer's new incarnation without stalling
its callers: attempts on a peer that stays gone back off, a host that does
not accept a connection is given up on without a handshake, and the waits
of many failed transfers make one attempt, not one each (every attempt runs
inside a post or a wait of the caller's)."""

from __future__ import annotations

import socket
import threading
import time
import types

import numpy as np
import pytest

import kvt.agent as agent_mod
from kvt import Agent
from kvt.errors import HandshakeError


@pytest.fixture
def pair():
    with Agent(name="a") as a, Agent(name="b") as b:
        for x in (a, b):
            x.register_blocks("kv", [np.zeros((4, 64), np.uint8)])
        yield a, a.connect(b.listen())


@pytest.fixture
def blackhole():
    """A TCP endpoint on loopback whose host never accepts a connection: a
    listener with a full backlog drops every SYN, as a host that is down or
    cut off does (no refusal comes back)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=5)  # the one queued connection
    yield f"tcp://127.0.0.1:{port}"
    filler.close()
    srv.close()


def _count(monkeypatch, name: str, result=None) -> list:
    """Record every call of ``kvt.agent.<name>``; with ``result``, answer it."""
    calls, real = [], getattr(agent_mod, name)

    def counted(*args, **kw):
        calls.append(args)
        if isinstance(result, BaseException):
            raise result
        return real(*args, **kw) if result is None else result

    monkeypatch.setattr(agent_mod, name, counted)
    return calls


def test_a_host_that_does_not_accept_is_given_up_on_without_a_handshake(pair, blackhole, monkeypatch):
    """The probe's connection timed out, and the attempt went on to the
    handshake anyway: every attempt on a host that was down took the
    probe's 0.5 s plus the handshake's 2 s."""
    a, peer = pair
    fetches = _count(monkeypatch, "fetch_info")
    a._reach[peer] = blackhole
    t0 = time.monotonic()
    a._recover(peer)
    took = time.monotonic() - t0
    assert not fetches, "the attempt asked for metadata from a host that never accepted a connection"
    due, failed = a._lost[peer]
    assert failed == 1
    # the next attempt waits ten times what this one cost: the caller loses at most a tenth of its time
    assert due - (t0 + took) >= agent_mod._RECOVER_SHARE * agent_mod._PROBE_S * 0.9


def test_an_explicit_reconnect_still_waits_for_the_handshake(pair, blackhole, monkeypatch):
    """Only the agent's own attempts give up at the probe: a caller's
    ``reconnect(timeout=...)`` is given its whole timeout (a SYN lost once
    is resent after 1 s)."""
    a, peer = pair
    fetches = _count(monkeypatch, "fetch_info", HandshakeError("no answer (test)"))
    a._reach[peer] = blackhole
    with pytest.raises(agent_mod.PeerDisconnected):
        a.reconnect(peer, timeout=1.0)
    assert len(fetches) == 1


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_attempts_on_a_peer_that_stays_gone_back_off(pair, monkeypatch):
    """Attempts came every 0.1 s for as long as a peer stayed gone: on a
    host that is down each one cost up to 2 s, so a caller that posted to it
    in a loop spent nearly all its time in attempts.  Now the pause doubles
    per failed attempt up to 1 s, an attempt that is not due is no attempt
    at all, and a success starts over."""
    a, peer = pair
    clock = _Clock()
    monkeypatch.setattr(agent_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep))
    probes = _count(monkeypatch, "_unreachable", "connection refused (test)")
    pauses = []
    for _ in range(7):
        a._recover(peer)
        a._recover(peer)  # not due: nothing
        due, failed = a._lost[peer]
        pauses.append(round(due - clock.now, 6))
        clock.now = due
    assert len(probes) == 7, "an attempt that was not due yet was made"
    assert pauses == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert failed == 7
    monkeypatch.setattr(agent_mod, "_unreachable", lambda *args, **kw: None)
    a._recover(peer)  # b answers again
    assert peer not in a._lost


def test_a_post_to_a_lost_peer_attempts_only_when_due(pair, monkeypatch):
    """``transfer_blocks`` to a lost peer runs an attempt first, but only
    once it is due: in between, posts go straight to the backend."""
    a, peer = pair
    clock = _Clock()
    monkeypatch.setattr(agent_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep))
    probes = _count(monkeypatch, "_unreachable", "connection refused (test)")
    a._recover(peer)
    for _ in range(5):
        a.read_blocks(peer, [0], [1]).release()
    assert len(probes) == 1, "posts made attempts before the pause was over"
    clock.now = a._lost[peer][0]
    a.read_blocks(peer, [0], [1]).release()
    assert len(probes) == 2


def test_the_waits_of_many_failed_transfers_make_one_attempt(pair, monkeypatch):
    """Every ``wait()`` of a transfer that failed as if the peer had gone
    ran an attempt of its own: a batch of such transfers waited on by
    several threads made as many attempts at once, each up to 2 s on a host
    that was down.  The first claims the attempt; the others return."""
    a, peer = pair
    entered, go, real = threading.Event(), threading.Event(), agent_mod.Agent._fetch
    calls = []

    def held(self, *args, **kw):
        calls.append(args)
        entered.set()
        assert go.wait(20)
        raise HandshakeError("no answer (test)")

    monkeypatch.setattr(agent_mod.Agent, "_fetch", held)
    first = threading.Thread(target=a._recover, args=(peer,), daemon=True)
    first.start()
    assert entered.wait(10)
    others = [threading.Thread(target=a._recover, args=(peer,), daemon=True) for _ in range(8)]
    for t in others:
        t.start()
    for t in others:
        t.join(10)
        assert not t.is_alive(), "a second attempt waited for the first"
    go.set()
    first.join(10)
    assert len(calls) == 1
    assert a._lost[peer][1] == 1
    monkeypatch.setattr(agent_mod.Agent, "_fetch", real)
