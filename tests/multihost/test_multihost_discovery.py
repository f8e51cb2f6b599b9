"""Discovery through a real etcd server on a test host: a decode agent finds
the prefill agent by name, stops finding it once its lease runs out after it
died, and finds its next incarnation again."""

from __future__ import annotations

import time


from cluster import need_backend

TTL = 2.0


def test_resolve_lease_expiry_and_restart_through_etcd(net, etcd, nodes):
    need_backend("host")
    a, b = net.hosts
    env = {"KVT_DISCOVERY": etcd}
    prefill = nodes(a, "prefill", "host", salt=7, publish="prefill-0", ttl=TTL, env=env, timeout=2.0)
    decode = nodes(b, "decode", "host", salt=3, env=env, timeout=2.0)
    assert decode.call("resolve", name="prefill-0") == {"endpoint": prefill.endpoint}
    peer = decode.call("connect", endpoint="prefill-0")["peer"]  # a name: resolved through etcd
    assert decode.read(peer, [0, 1], [2, 3], salt=7) == {"ok": True, "verified": True}

    time.sleep(TTL * 1.5)  # alive: its lease is kept alive past the ttl
    assert decode.call("resolve", name="prefill-0") == {"endpoint": prefill.endpoint}

    prefill.kill()  # SIGKILL: nothing withdraws the name, only the lease's end does
    t0 = time.monotonic()
    while (rep := decode.call("resolve", name="prefill-0")).get("error") != "UnknownPeer":
        assert rep == {"endpoint": prefill.endpoint}, rep
        assert time.monotonic() - t0 < TTL + 5, "the dead agent's lease never expired"
        time.sleep(0.2)
    assert decode.read(peer, [0], [0], salt=7).get("error") in ("PeerDisconnected", "TransferTimeout")

    # a new process under the same name, on another port: found again through the store
    prefill = nodes(a, "prefill", "host", salt=8, publish="prefill-0", ttl=TTL, env=env, timeout=2.0)
    assert decode.read(peer, [4, 5], [6, 7], salt=8) == {"ok": True, "verified": True}


def test_unreachable_store_is_a_typed_error(net, nodes):
    need_backend("host")
    a, b = net.hosts
    decode = nodes(b, "decode", "host", env={"KVT_DISCOVERY": f"etcd://{a.addr}:2379"})  # nobody there
    rep = decode.call("resolve", name="prefill-0")
    assert rep["error"] == "DiscoveryError" and "unreachable" in rep["msg"], rep
