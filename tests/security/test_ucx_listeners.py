"""Where the UCX-based backends listen.  Over its tcp transport UCX serves
RMA in software, in the target process, at whatever address a request
names: no remote key is checked.  A raw UCX worker that knew only a kvt
agent's UCX port (no metadata, no key: a port scan) read memory the agent
never registered and crashed it with a read of an unmapped address, through
the machine's network interface.  So the ucx and nixl backends keep UCX's
network devices on loopback unless the operator names interfaces
(``UCX_NET_DEVICES``; docs/security.md), and refuse a peer on another host
while they do, saying which setting to make."""

from __future__ import annotations

import os
import socket

import msgspec
import pytest
from kvt.errors import ConfigError
from kvt.wire import decode, encode

pytestmark = pytest.mark.timeout(120)


def _listening() -> set[str]:
    """The addresses this process's listening TCP sockets are bound to."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    out = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as f:
            for line in f.readlines()[1:]:
                field = line.split()
                if field[3] != "0A" or int(field[9]) not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(field[1].split(":")[0])  # host-order 32-bit words
                out.add(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return out


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


def _backend(kind: str):
    if kind == "ucx":
        return pytest.importorskip("kvt_ucx").UcxBackend
    return pytest.importorskip("kvt_nixl").NixlBackend


@pytest.fixture(params=["ucx", "nixl"])
def kind(request, monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    cls = _backend(request.param)
    if not cls.availability().usable:
        pytest.skip(f"{request.param}: {cls.availability().reason}")
    return request.param


def test_ucx_listens_on_loopback_only_unless_told(kind):
    if not [name for _, name in socket.if_nameindex() if name != "lo"]:
        pytest.skip("no network interface but loopback here: UCX could listen nowhere else")
    before = _listening()
    b = _backend(kind)("me", {})
    try:
        opened = _listening() - before
    finally:
        b.close()
    assert opened and all(_loopback(a) for a in opened), opened  # it listened on eth0 too


def test_a_peer_on_another_host_is_refused_with_the_setting_to_make(kind):
    a, b = _backend(kind)("a", {}), _backend(kind)("b", {})
    try:
        md = b.local_metadata()
        if kind == "ucx":
            from kvt_ucx.backend import UcxMetadata as Md
            field = "host"
        else:
            from kvt_nixl.metadata import NixlMetadata as Md
            field = "host_id"
        elsewhere = encode(msgspec.structs.replace(decode(md, Md), **{field: "another-host"}))
        with pytest.raises(ConfigError, match="UCX_NET_DEVICES"):
            a.add_remote(elsewhere)
        assert a.add_remote(md) == "b"  # the same peer on this host pairs as before
    finally:
        a.close()
        b.close()
