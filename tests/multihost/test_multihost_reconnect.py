"""Peers that come back: a prefill agent killed and restarted under the same
name (new process, new memory contents) on another test host.  The decode
agent picks it up with no call from the user, and nothing that was meant for
the old process ever ends DONE with its (stale) data."""

from __future__ import annotations

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
