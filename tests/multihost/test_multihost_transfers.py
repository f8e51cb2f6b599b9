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
