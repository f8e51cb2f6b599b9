"""How an Agent looks for a lost peer's new incarnation without stalling
its callers: an attempt runs on a thread of its own, the call that started
it waits only briefly, a host that does not accept a connection is given up
on without a handshake, the waits of many failed transfers make one attempt,
not one each, and attempts on a peer that stays gone back off."""

from __future__ import annotations

import socket
import threading
import time

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


def _settle(a: Agent, peer: str) -> None:
    """Until the attempt running on ``peer`` (if any) has ended."""
    done = a._recovering.get(peer)
    assert done is None or done.wait(10), "an attempt did not end"


def _held_fetch(monkeypatch) -> tuple[list, threading.Event, threading.Event]:
    """``Agent._fetch`` that blocks until ``go`` is set, then fails: a peer
    whose host accepts connections but whose process does not answer."""
    calls, entered, go = [], threading.Event(), threading.Event()

    def held(self, *args, **kw):
        calls.append(args)
        entered.set()
        assert go.wait(20)
        raise HandshakeError("no answer (test)")

    monkeypatch.setattr(agent_mod.Agent, "_fetch", held)
    return calls, entered, go


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
    _settle(a, peer)
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
    that was down.  The first claims the attempt; the others make none
    (they wait for it, ``_RECOVER_WAIT`` at most)."""
    a, peer = pair
    calls, entered, go = _held_fetch(monkeypatch)
    a._recover(peer)
    assert entered.wait(10)
    others = [threading.Thread(target=a._recover, args=(peer,), daemon=True) for _ in range(8)]
    for t in others:
        t.start()
    for t in others:
        t.join(10)
        assert not t.is_alive(), "a wait for the attempt in flight did not end at _RECOVER_WAIT"
    go.set()
    _settle(a, peer)
    assert len(calls) == 1
    assert peer in a._lost and not a._recovering


def test_the_caller_does_not_wait_out_an_attempt_on_a_frozen_peer(pair, monkeypatch):
    """A frozen process's host accepts the connection, so an attempt waits
    out the whole handshake (2 s): it ran on the caller's thread, inside a
    ``wait()`` or a post.  Now the caller waits ``_RECOVER_WAIT`` at most and
    the attempt goes on by itself."""
    a, peer = pair
    calls, entered, go = _held_fetch(monkeypatch)
    try:
        a._recover(peer)  # returns while the handshake is still held
        assert entered.is_set() and peer in a._recovering, "the attempt did not start, or ended"
    finally:
        go.set()
    _settle(a, peer)
    assert len(calls) == 1 and peer in a._lost


def test_the_caller_sees_the_outcome_of_a_quick_attempt(pair, monkeypatch):
    """A peer restarted nearby answers within the wait: the caller's next
    transfer reaches the new incarnation (the attempt reloaded it before
    the caller went on)."""
    a, peer = pair
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 30.0)  # a loaded CI machine: no race on the wait
    loads = _count(monkeypatch, "fetch_info")
    a._lost[peer], a._backoff[peer] = 0.0, 0.4  # lost, and due
    a._recover(peer)
    assert len(loads) == 1 and peer not in a._recovering
    assert peer not in a._lost and peer not in a._backoff, "the reload did not mark the peer found"
    a.read_blocks(peer, [0], [1]).wait(10)


def test_attempts_on_a_peer_that_stays_gone_back_off(pair, monkeypatch):
    """Without a pause between attempts, every post to a peer that stayed
    gone made one every 0.1 s, for as long as it was down.  The pause
    doubles from 0.1 s to 1 s, and calls during it make none."""
    a, peer = pair
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 0.0)  # no call waits for the pause's end
    fetches = _count(monkeypatch, "fetch_info", HandshakeError("no answer (test)"))
    pauses = []
    for n in range(1, 7):
        a._recover(peer)
        _settle(a, peer)
        assert len(fetches) == n
        pauses.append(a._backoff[peer])
        a._recover(peer)  # within the pause: no attempt
        _settle(a, peer)
        assert len(fetches) == n, "an attempt started before the pause after the last one had passed"
        a._lost[peer] -= pauses[-1]  # the pause has passed
    assert pauses == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_call_near_the_end_of_a_pause_waits_for_it(pair, monkeypatch):
    """A loop of transfers to a peer that is coming back must not fail by
    the hundred within one pause, each at once: a call within
    ``_RECOVER_WAIT`` of the pause's end waits it out and makes the
    attempt (not earlier)."""
    a, peer = pair
    times = []

    def refused(*args, **kw):
        times.append(time.monotonic())
        raise HandshakeError("no answer (test)")

    monkeypatch.setattr(agent_mod, "fetch_info", refused)
    a._recover(peer)
    _settle(a, peer)
    due = a._lost[peer]
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 10.0)
    a._recover(peer)
    assert len(times) == 2, "the call did not wait for the pause's end to make an attempt"
    assert times[1] >= due, "the attempt started before the pause had passed"


def test_calls_during_an_attempt_wait_for_it(pair, monkeypatch):
    """While an attempt runs, waits of failed transfers and posts to the
    peer wait for it (``_RECOVER_WAIT`` at most) instead of failing at once
    against the old incarnation, many times over."""
    a, peer = pair
    calls, entered, go = _held_fetch(monkeypatch)
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 0.0)
    a._recover(peer)
    assert entered.wait(10)
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 20.0)
    threading.Timer(0.3, go.set).start()
    a._recover(peer)  # the wait of a failed transfer
    assert peer not in a._recovering, "a wait returned while the attempt was still running"
    go.clear()
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 0.0)
    del a._lost[peer], a._backoff[peer]  # found again meanwhile: the next failure starts afresh
    a._recover(peer)
    assert entered.wait(10) and peer in a._recovering
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 20.0)
    threading.Timer(0.3, go.set).start()
    a.read_blocks(peer, [0], [1]).wait(10)  # a post: b is still there, so it lands
    assert peer not in a._recovering, "a post went ahead while an attempt on its peer was running"
    assert len(calls) == 2


def test_a_post_to_a_healthy_peer_makes_no_attempt_while_another_is_lost(pair, monkeypatch):
    """Posts look for a lost peer first; one to a peer that is not lost
    must not start an attempt (a reload of a healthy peer) because some
    other peer is."""
    a, peer = pair
    with Agent(name="c") as c:
        c.register_blocks("kv", [np.zeros((4, 64), np.uint8)])
        healthy = a.connect(c.listen())
        fetches = _count(monkeypatch, "fetch_info")
        a._lost[peer], a._backoff[peer] = time.monotonic() + 60, 1.0  # lost, in a long pause
        a.read_blocks(healthy, [0], [1]).wait(10)
        _settle(a, healthy)
        assert not fetches, "a post to a healthy peer asked it for its metadata again"


def test_close_waits_for_an_attempt_loading_the_peer(pair, monkeypatch):
    """An attempt runs on a thread of the agent's: ``close()`` must not close
    the backend under its ``add_remote``: it waits for the load to end."""
    a, peer = pair
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 0.0)
    entered, go, order = threading.Event(), threading.Event(), []
    real_add, real_close = a.backend.add_remote, a.backend.close

    def add_remote(md):
        entered.set()
        assert go.wait(20)
        order.append("add_remote")
        return real_add(md)

    def close():
        order.append("close")
        real_close()

    monkeypatch.setattr(a.backend, "add_remote", add_remote)
    monkeypatch.setattr(a.backend, "close", close)
    a._recover(peer)
    assert entered.wait(10)
    closer = threading.Thread(target=a.close, daemon=True)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() did not wait for the load in progress"
    go.set()
    closer.join(10)
    assert order == ["add_remote", "close"]


def test_peers_lost_together_are_looked_for_a_few_at_a_time(pair, monkeypatch):
    """An attempt is a thread: an agent whose many peers died at once (a
    rack lost its power) started one per peer its callers still posted to.
    At most ``_MAX_ATTEMPTS`` run at once; calls about the other peers
    return at once and mark them lost, and a later call makes their
    attempt once a slot is free."""
    a, peer = pair
    monkeypatch.setattr(agent_mod, "_RECOVER_WAIT", 0.0)
    calls, entered, go = _held_fetch(monkeypatch)
    most = agent_mod._MAX_ATTEMPTS
    ghosts = [f"ghost-{i}" for i in range(most + 3)]
    for g in ghosts:
        a._reach[g] = a._reach[peer]  # each answers as a frozen process would (held)
    try:
        for g in ghosts:
            a._recover(g)
        deadline = time.monotonic() + 10
        while len(calls) < most and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # an attempt past the bound would have started by now
        running = [t for t in threading.enumerate() if t.name.startswith("kvt-recover-")]
        assert len(calls) == most and len(running) == most, f"{len(running)} attempts at once (at most {most})"
        assert sorted(a._recovering) == sorted(ghosts[:most])
        assert all(g in a._lost for g in ghosts), "a peer left without an attempt was not marked lost"
    finally:
        go.set()
    for g in ghosts[:most]:
        _settle(a, g)
    a._recover(ghosts[-1], lost_only=True)  # a post to a peer whose turn had not come
    _settle(a, ghosts[-1])
    assert len(calls) == most + 1, "a peer turned away at the bound was not looked for once a slot was free"


def test_no_thread_for_an_attempt_leaves_nothing_claimed(pair, monkeypatch):
    """A process at its thread limit cannot start the attempt: the call
    returns (its transfer fails as it would have), and neither the peer's
    claim nor a slot stays taken, so a later call makes the attempt."""
    a, peer = pair
    fetches = _count(monkeypatch, "fetch_info", HandshakeError("no answer (test)"))
    real_start = threading.Thread.start

    def no_thread(self):
        if self.name.startswith("kvt-recover-"):
            raise RuntimeError("can't start new thread (test)")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    for _ in range(agent_mod._MAX_ATTEMPTS + 1):
        a._recover(peer)
    assert not a._recovering and not fetches
    monkeypatch.setattr(threading.Thread, "start", real_start)
    a._recover(peer)
    _settle(a, peer)
    assert len(fetches) == 1, "the attempt was not made once a thread could be had"
