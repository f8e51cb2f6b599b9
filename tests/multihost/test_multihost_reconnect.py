"""Peers that come back: a prefill agent killed and restarted under the same
name (new process, new memory contents) on another test host.  The decode
agent picks it up with no call from the user, and nothing that was meant for
the old process ever ends DONE with its (stale) data."""

from __future__ import annotations

import time

import pytest

from cluster import BACKENDS, need_backend

PORT = 7800  # the side channel's port on its test host: the restarted agent listens there again
LOST = ("PeerDisconnected", "TransferTimeout")


@pytest.mark.parametrize("backend", BACKENDS)
def test_restarted_peer_is_picked_up(net, nodes, backend):
    need_backend(backend)
    a, b = net.hosts
    prefill = nodes(a, "prefill", backend, salt=7, port=PORT, timeout=3.0)
    decode = nodes(b, "decode", backend, salt=3, timeout=3.0)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    assert decode.read(peer, [0, 1], [4, 5], salt=7) == {"ok": True, "verified": True}

    prefill.kill()
    prefill = nodes(a, "prefill", backend, salt=8, port=PORT, timeout=3.0)  # same name, other contents

    first = decode.read(peer, [2, 3], [6, 7], salt=8)
    # the one transfer that may still have gone to the old process fails cleanly...
    assert first == {"ok": True, "verified": True} or first.get("error") in LOST, first
    # ...and the next one reaches the new process: no reconnect call from the user
    assert decode.read(peer, [2, 3], [6, 7], salt=8) == {"ok": True, "verified": True}
    assert decode.read(peer, list(range(32)), list(range(32)), salt=8) == {"ok": True, "verified": True}


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_that_stays_down_fails_cleanly(net, nodes, backend):
    need_backend(backend)
    a, b = net.hosts
    prefill = nodes(a, "prefill", backend, salt=7, port=PORT, timeout=2.0)
    decode = nodes(b, "decode", backend, salt=3, timeout=2.0)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    prefill.kill()
    for _ in range(2):  # the transfer, then the reconnect attempt: both typed errors, neither hangs
        rep = decode.read(peer, [0], [0], salt=7, timeout=15)
        assert rep.get("error") in LOST, rep


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_back_under_another_name_fails_at_once_saying_to_connect_again(net, nodes, backend):
    """An agent whose name was drawn at start comes back as another peer:
    once the route is found to lead there, transfers to the old name fail
    with PeerDisconnected naming the new agent and what to do, and make no
    further attempts."""
    need_backend(backend)
    a, b = net.hosts
    prefill = nodes(a, "prefill-1", backend, salt=7, port=PORT, timeout=3.0)
    decode = nodes(b, "decode", backend, salt=3, timeout=3.0)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    prefill.kill()
    nodes(a, "prefill-2", backend, salt=8, port=PORT, timeout=3.0)
    first = decode.read(peer, [0], [0], salt=8)
    assert first.get("error") in LOST, first
    for _ in range(2):
        rep = decode.read(peer, [0], [0], salt=8)
        assert rep.get("error") == "PeerDisconnected", rep
        assert "'prefill-2'" in rep["msg"] and "connect(" in rep["msg"], rep
    assert decode.call("connect", endpoint=prefill.endpoint)["peer"] == "prefill-2"
    assert decode.read("prefill-2", [0], [0], salt=8) == {"ok": True, "verified": True}


@pytest.mark.parametrize("backend", BACKENDS)
def test_attempts_on_a_killed_peer_do_not_wait_out_the_handshake_timeout(net, nodes, backend):
    """A killed process's port refuses connections: each attempt to fetch
    its metadata again fails at once instead of waiting 2 s, so a loop of
    transfers to it is not slowed to one per 2-4 s."""
    need_backend(backend)
    a, b = net.hosts
    prefill = nodes(a, "prefill", backend, salt=7, port=PORT, timeout=3.0)
    decode = nodes(b, "decode", backend, salt=3, timeout=3.0)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    prefill.kill()
    assert decode.read(peer, [0], [0], salt=7).get("error") in LOST  # noticed (within the 3 s timeout)
    for _ in range(3):
        time.sleep(0.15)  # past the 0.1 s between attempts: each read makes one
        t0 = time.monotonic()
        rep = decode.read(peer, [0], [0], salt=7)
        took = time.monotonic() - t0
        assert rep.get("error") in LOST, rep
        # an attempt that waited for an answer would take 2 s (the cap on one attempt)
        assert took < 1.5, f"a transfer to a killed peer took {took:.2f}s: the attempt waited out a timeout"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_host_that_stops_answering_costs_its_callers_little(net, nodes, backend):
    """A host that is down or cut off sends nothing back, not even a
    refusal.  Each ``wait()`` of a transfer that failed on it ran an attempt
    to reach it again, and each attempt waited out a connection (0.5 s) and
    then the handshake (2 s): a loop of transfers to it spent 2.5 s per
    transfer in attempts.  An attempt then gave up when the host did not
    accept the probe's connection (0.5 s per transfer); now attempts run
    off the caller's thread, which waits for one 0.1 s at most, and back
    off while the host stays down."""
    need_backend(backend)
    a, b = net.hosts
    prefill = nodes(a, "prefill", backend, salt=7, port=PORT, timeout=2.0)
    decode = nodes(b, "decode", backend, salt=3, timeout=2.0)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    a.netem(loss_pct=100)  # every packet host a sends is lost: it looks down from b
    try:
        rep = decode.read(peer, [0], [0], salt=7, timeout=15)
        assert rep.get("error") in LOST, rep  # noticed at the 2 s deadline, and one attempt made
        t0 = time.monotonic()
        for _ in range(4):
            rep = decode.read(peer, [0], [0], salt=7, timeout=15)
            assert rep.get("error") in LOST, rep
        took = time.monotonic() - t0
        # attempts on the caller's thread: 0.5 s each (the probe), 2.5 s with the handshake
        assert took < 1.2, f"four transfers to a host that stopped answering took {took:.2f}s: the callers " \
                           "waited out attempts to reach it again"
    finally:
        a.netem()
