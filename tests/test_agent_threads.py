"""One Agent called from several threads: a scheduler posting, a control
thread loading and removing peers, a completion thread waiting and
reconnecting.  Each race is made deterministic by holding one call at the
point where the other must get in (found by a concurrency audit)."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from kvt import Agent
from kvt.errors import KvtTimeoutError, PeerDisconnected


@pytest.fixture
def pair():
    with Agent(name="a") as a, Agent(name="b") as b, Agent(name="c") as c:
        for x in (a, b, c):
            x.register_blocks("kv", [np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)])
        yield a, b, c


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _held(monkeypatch, obj, attr):
    """Make ``obj.attr`` wait at its start until the returned event is set;
    ``entered`` is set once a caller is inside."""
    entered, go, real = threading.Event(), threading.Event(), getattr(obj, attr)

    def held(*args, **kw):
        entered.set()
        assert go.wait(20)
        return real(*args, **kw)

    monkeypatch.setattr(obj, attr, held)
    return entered, go


def test_a_peer_removed_while_it_is_reconnected_stays_removed(pair, monkeypatch):
    """reconnect (what Transfer.wait's recovery calls) fetched the metadata,
    then loaded the peer again after remove_peer had returned."""
    a, b, _ = pair
    name = a.connect(b.listen())
    entered, go = _held(monkeypatch, a, "_fetch")
    t, out = _in_thread(lambda: a.reconnect(name))
    assert entered.wait(10)
    a.remove_peer(name)
    go.set()
    t.join(20)
    assert isinstance(out.get("error"), PeerDisconnected), out
    assert "removed" in str(out["error"])
    assert name not in a.peers and name not in a.backend._peers
    a._recover(name)  # recovery of a removed peer leaves nothing behind
    assert name not in a._lost


def test_a_peer_load_that_waits_holds_up_no_other_peer_or_notifications(pair, monkeypatch):
    """add_peer held the agent-wide lock across the backend's add_remote:
    while one peer's reload waited (host waits for the peer's lane, up to
    twice the transfer timeout), notifications and other peers waited too."""
    a, b, c = pair
    name = a.connect(b.listen())
    entered, go = _held(monkeypatch, a.backend, "add_remote")
    t, out = _in_thread(lambda: a.reconnect(name))
    try:
        assert entered.wait(10)
        monkeypatch.undo()  # c's load goes straight through
        t0 = time.monotonic()
        assert a.get_notifs() == {}
        with pytest.raises(KvtTimeoutError):
            a.wait_notif(timeout=0.2)
        other = a.connect(c.listen())
        with a.read_blocks(other, [0], [1]) as x:
            x.wait(5)
        assert time.monotonic() - t0 < 5
    finally:
        go.set()
        t.join(20)
    assert out.get("value") is False, out


def test_host_reloading_a_busy_peer_holds_up_no_other_peer(pair):
    """The host backend waited for a busy peer's lane under its own lock."""
    a, b, c = pair
    a.add_peer(b.info())
    lane, release = a.backend._peers["b"].lane, threading.Event()
    lane.submit(release.wait, 20)  # the peer's worker is busy (a long copy)
    t, out = _in_thread(lambda: a.add_peer(b.info()))
    try:
        time.sleep(0.2)
        assert t.is_alive()  # waiting for b's lane
        t0 = time.monotonic()
        a.add_peer(c.info())
        with a.read_blocks("c", [0], [1]) as x:
            x.wait(5)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        t.join(20)
    assert out.get("value") == "b", out


def test_a_lost_peer_recovered_meanwhile_is_no_key_error(pair):
    """A post read ``_lost[peer]`` after checking ``peer in _lost``; another
    thread's recovery or remove_peer popped it in between (KeyError)."""
    a, b, _ = pair
    name = a.connect(b.listen())

    class PoppedMeanwhile(dict):
        def __contains__(self, key):  # another thread pops it right after the check
            found = dict.__contains__(self, key)
            self.pop(key, None)
            return found

    a._lost = PoppedMeanwhile({name: time.monotonic() - 1})
    with a.read_blocks(name, [0], [1]) as x:
        x.wait(5)


@pytest.mark.parametrize("cached", [False, True], ids=["fresh-route", "cached-route"])
def test_a_post_racing_a_peer_reload_waits_for_the_new_layout(pair, monkeypatch, cached):
    """Between the backend's add_remote and the agent's tables taking the
    new AgentInfo, a post built its route from the old layout: the old
    addresses, refused by the peer (a descriptor error instead of the read)."""
    a, b, _ = pair
    name = a.connect(b.listen())
    if cached:
        with a.read_blocks(name, [0], [1]) as x:
            x.wait(5)
    new = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)[::-1].copy()
    b.register_blocks("kv", [new])  # the old buffer is deregistered: its addresses are refused now
    info = b.info()
    real, entered, go = a.backend.add_remote, threading.Event(), threading.Event()

    def held(md):
        out = real(md)
        entered.set()
        assert go.wait(20)
        return out

    monkeypatch.setattr(a.backend, "add_remote", held)
    t, out = _in_thread(lambda: a.add_peer(info))
    assert entered.wait(10)
    p, got = _in_thread(lambda: a.read_blocks(name, [2], [3]).wait(10))
    time.sleep(0.2)
    go.set()
    t.join(20)
    p.join(20)
    assert out.get("value") == name, out
    assert "error" not in got, got
    mine = (ctypes.c_uint8 * 256).from_address(a.layouts["kv"].base_addrs[0])
    np.testing.assert_array_equal(np.frombuffer(mine, np.uint8).reshape(4, 64)[2], new[3])


def test_every_peer_name_has_a_lock_of_its_own(pair):
    """Loads of different peers never wait for each other: with 16 striped
    locks, two names in one stripe did (the two tests above failed for 1
    process hash seed in 16: PYTHONHASHSEED=16 put "b" and "c" together)."""
    a, _, _ = pair
    locks = [a._peer_lock(f"peer-{i}") for i in range(64)]
    assert len({id(lock) for lock in locks}) == len(locks)
    assert a._peer_lock("peer-0") is locks[0]  # one name, one lock, while in use
