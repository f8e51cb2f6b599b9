"""kvt.discovery without a network: torch's TCPStore in this process (the
etcd store runs against a real etcd in tests/multihost/test_discovery.py)."""

from __future__ import annotations

import socket
import time

import pytest

from kvt.discovery import TcpStore, _PREFIX, open_store
from kvt.errors import ConfigError, DiscoveryError, InvalidArgument, UnknownPeer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    s = open_store(f"tcpstore://127.0.0.1:{free_port()}?server=1")
    yield s
    s.close()


def test_publish_resolve_withdraw(store):
    store.publish("prefill-0", "tcp://10.1.2.3:7800", ttl=5)
    assert store.resolve("prefill-0") == "tcp://10.1.2.3:7800"
    store.withdraw("prefill-0")
    with pytest.raises(UnknownPeer, match="prefill-0"):
        store.resolve("prefill-0")


def test_record_expires_when_its_publisher_stops_renewing(store):
    store.publish("p", "tcp://10.1.2.3:1", ttl=1)
    time.sleep(1.5)
    assert store.resolve("p") == "tcp://10.1.2.3:1"  # renewed meanwhile
    store._stop.set()  # the publisher "dies": nothing renews any more
    time.sleep(1.5)
    with pytest.raises(UnknownPeer, match="lease expired"):
        store.resolve("p")


@pytest.mark.parametrize("raw", [b"not json", b'{"endpoint": "http://evil"}', b'{"endpoint": 5}',
                                 b'{"endpoint": "tcp://a:1", "expires": "never"}', b"{" + b" " * 5000 + b"}"])
def test_hostile_records_are_typed_errors(store, raw):
    store._s.set(_PREFIX + "p", raw)
    with pytest.raises(DiscoveryError, match="unreadable record"):
        store.resolve("p")


def test_bad_names_urls_and_ttls(store):
    for name in ("", "a/b", "x" * 201, "../etc"):
        with pytest.raises(InvalidArgument):
            store.resolve(name)
    with pytest.raises(InvalidArgument, match="ttl"):
        store.publish("p", "tcp://a:1", ttl=0.1)
    for url in (None, "", "zk://a:1", "tcpstore://nohost"):
        with pytest.raises(ConfigError):
            open_store(url)


def test_unreachable_stores_are_typed_errors():
    with pytest.raises(DiscoveryError, match="unreachable"):
        open_store(f"etcd://127.0.0.1:{free_port()}").resolve("p", timeout=1)
    with pytest.raises(DiscoveryError):
        TcpStore("127.0.0.1", free_port(), timeout=1)


def test_agent_connects_by_name(store):
    import numpy as np
    from kvt import Agent

    url = f"tcpstore://127.0.0.1:{store._s.port}"
    with Agent(name="prefill", options={"timeout": 5}) as p, Agent(name="decode", options={"timeout": 5}) as d:
        src = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
        dst = np.zeros_like(src)
        p.register_blocks("kv", [src])
        d.register_blocks("kv", [dst])
        p.config.discovery = d.config.discovery = url
        p.publish("prefill-0", ttl=5)
        assert d.connect("prefill-0") == "prefill"
        d.read_blocks("prefill", [0, 1], [2, 3]).wait(10)
        assert np.array_equal(dst[:2], src[2:])
