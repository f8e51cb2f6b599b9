"""How an Agent looks for a lost peer's new incarnation without stalling
its callers (every attempt runs inside a post or a wait of the caller's): a
host that does not accept a connection is given up on without a handshake,
and the waits of many failed transfers make one attempt, not one each."""

from __future__ import annotations

import socket
import threading

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
    a._recover(peer)
    assert not fetches, "the attempt asked for metadata from a host that never accepted a connection"
    assert peer in a._lost  # still gone: posts try again later


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
    assert peer in a._lost and not a._recovering
    monkeypatch.setattr(agent_mod.Agent, "_fetch", real)
