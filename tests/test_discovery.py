"""kvt.discovery without a network: torch's TCPStore in this process (the
etcd store runs against a real etcd in tests/multihost/test_discovery.py)."""

from __future__ import annotations

import socket
import time

import pytest

from kvt.discovery import TcpStore, _PREFIX, open_store
from kvt.errors import ConfigError, DiscoveryError, InvalidArgument, UnknownPeer
from kvt_conformance.peer import freeze


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
    store.publish("p", "tcp://10.1.2.3:1", ttl=2)  # renewed every 0.67 s: a stall under 1.3 s is no miss
    time.sleep(3)
    assert store.resolve("p") == "tcp://10.1.2.3:1"  # renewed meanwhile
    with store._writing:  # the publisher "dies" (no renewal in progress): nothing renews any more
        store._stop.set()
    time.sleep(3)
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
    for url in (None, "", "zk://a:1", "tcpstore://nohost", "tcpstore://127.0.0.1:99999", "tcpstore://h:abc",
                "tcpstore://[::1", "etcd://[::1"):  # the last four raised ValueError from urllib
        with pytest.raises(ConfigError):
            open_store(url)


def test_a_malformed_discovery_url_is_refused_when_the_config_loads(monkeypatch):
    from kvt.config import load_config

    monkeypatch.setenv("KVT_DISCOVERY", "tcpstore://127.0.0.1:99999")
    with pytest.raises(ConfigError, match="KVT_DISCOVERY.*malformed"):
        load_config()


def _silent_listener():
    """A port that accepts connections and never answers (a hung store host, another service)."""
    s = socket.create_server(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def test_a_store_that_never_answers_is_a_discovery_error_within_the_timeout():
    # before: the c10d client's calls blocked without end (connect and resolve alike)
    listener, port = _silent_listener()
    with listener:
        t0 = time.monotonic()
        with pytest.raises(DiscoveryError, match="did not answer"):
            TcpStore("127.0.0.1", port, timeout=1)
        assert time.monotonic() - t0 < 30


def test_a_store_that_stops_answering_fails_resolves_in_time_and_serves_again_after():
    import os
    import signal
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time\nfrom torch.distributed import TCPStore\n"
        "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
        "timeout=datetime.timedelta(seconds=5))\nprint(s.port, flush=True)\ntime.sleep(300)")],
        stdout=subprocess.PIPE, text=True)
    try:
        client = open_store(f"tcpstore://127.0.0.1:{server.stdout.readline().strip()}")
        client.publish("p", "tcp://10.1.2.3:7", ttl=60)
        freeze(server.pid)  # the store's host hangs (every thread stopped: a bare SIGSTOP lets one answer)
        t0 = time.monotonic()
        with pytest.raises(DiscoveryError, match="within 1s"):
            found = client.resolve("p", timeout=1)
            pytest.fail(f"resolved {found!r} while the store's host was stopped")
        with pytest.raises(DiscoveryError, match="earlier call"):  # at once: no second thread left waiting
            client.resolve("p", timeout=1)
        assert time.monotonic() - t0 < 20
        os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.resolve("p", timeout=5) == "tcp://10.1.2.3:7"
                break
            except DiscoveryError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        client.close()
    finally:
        server.kill()
        server.wait()


def test_unreachable_stores_are_typed_errors():
    with pytest.raises(DiscoveryError, match="unreachable"):
        open_store(f"etcd://127.0.0.1:{free_port()}").resolve("p", timeout=1)
    with pytest.raises(DiscoveryError):
        TcpStore("127.0.0.1", free_port(), timeout=1)


def test_an_abandoned_connect_does_not_abort_the_process_at_exit(tmp_path):
    # before: c10d gave up on the connect while the interpreter finalised, and its
    # thread's return killed the process ("terminate called without an active exception")
    import subprocess
    import sys

    script = tmp_path / "exit_after_refusal.py"
    script.write_text(f"""
import sys, time
from kvt.discovery import TcpStore
from kvt.errors import DiscoveryError

class SlowTeardown:  # keeps the interpreter finalising until c10d's retries have ended
    def __del__(self, sys=sys, time=time):
        time.sleep(4)
        sys.stderr.write("finalised\\n")

keep = SlowTeardown()
try:
    TcpStore("127.0.0.1", {free_port()}, timeout=1)
except DiscoveryError as e:
    print("refused:", e)
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "refused: " in run.stdout and "did not answer" in run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "finalised" in run.stderr


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
