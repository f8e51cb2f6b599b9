"""Transfers between two test hosts (network namespaces): every backend over
its network path, every byte checked."""

from __future__ import annotations

import pytest

from cluster import BACKENDS, need_backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_and_write_across_hosts(net, nodes, backend):
    need_backend(backend)
    prefill_host, decode_host = net.hosts
    prefill = nodes(prefill_host, "prefill", backend, salt=7)
    decode = nodes(decode_host, "decode", backend, salt=3)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    assert peer == "prefill"
    if backend == "host":  # another host: neither shared memory nor cross-memory attach
        assert decode.call("paths")["prefill"]["same_host"] is False
    rep = decode.read(peer, [0, 5, 9, 31], [3, 5, 20, 31], salt=7)
    assert rep == {"ok": True, "verified": True}, rep
    rep = decode.call("write", peer=peer, local=[1, 2], remote=[10, 11], salt=3)
    assert rep == {"ok": True}, rep
    assert prefill.call("check", ids=[10, 11], salt=3) == {"verified": True}


@pytest.mark.parametrize("backend", BACKENDS)
def test_agents_sharing_a_key_across_hosts_and_others_refused(net, nodes, backend):
    """With ``auth_key`` the side channel (and host's data server) speak ZMQ's
    CURVE keyed from it: agents that share it move and check every byte over
    the veth; one without a key, or with another, is refused at once with
    ``AuthenticationError`` (not after its timeout)."""
    need_backend(backend)
    key, a, b = {"KVT_AUTH_KEY": "multihost-" + "k" * 32}, *net.hosts
    prefill = nodes(a, "prefill", backend, salt=7, env=key)
    decode = nodes(b, "decode", backend, salt=3, env=key)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    assert decode.read(peer, [0, 5, 31], [3, 20, 31], salt=7) == {"ok": True, "verified": True}
    assert decode.call("write", peer=peer, local=[1], remote=[10], salt=3) == {"ok": True}
    assert prefill.call("check", ids=[10], salt=3) == {"verified": True}
    for name, env in (("keyless", {}), ("other-key", {"KVT_AUTH_KEY": "another-" + "k" * 32})):
        other = nodes(b, name, backend, env=env, timeout=60.0)
        rep = other.call("connect", endpoint=prefill.endpoint)
        assert rep["error"] == "AuthenticationError" and "auth_key" in rep["msg"], (name, rep)
