"""Fixtures for tests across test hosts (network namespaces): skipped with the
reason where namespaces cannot be made (not root, no iproute2/iptables), or
failed under ``KVT_REQUIRE_HOSTS=1``."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest

from cluster import Node, hosts_unavailable, skip_unless_required
from netns import Network


@pytest.fixture
def net():
    if why := hosts_unavailable():
        skip_unless_required(f"test hosts unavailable: {why}")
    with Network(2) as n:
        yield n


@pytest.fixture
def nodes():
    """Start nodes with ``nodes(host, name, backend, ...)``; all are killed at the end."""
    made: list[Node] = []

    def start(*args, **kwargs) -> Node:
        made.append(Node(*args, **kwargs))
        return made[-1]

    yield start
    for n in made:
        n.close()


@pytest.fixture
def etcd(net):
    """A real etcd server on the first test host; yields its ``etcd://`` URL."""
    import shutil

    if not shutil.which("etcd"):
        skip_unless_required("etcd is not installed (`scripts/dev test` installs the etcd-server package as root)")
    host = net.hosts[0]
    with tempfile.TemporaryDirectory() as data:
        client, peer = f"http://{host.addr}:2379", f"http://{host.addr}:2380"
        log = tempfile.TemporaryFile()
        proc = host.popen(["etcd", "--name", "kvt", "--data-dir", data, "--listen-client-urls", client,
                           "--advertise-client-urls", client, "--listen-peer-urls", peer,
                           "--initial-advertise-peer-urls", peer, "--initial-cluster", f"kvt={peer}"],
                          stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:  # ready once it answers a read (asked from inside its namespace)
                r = host.run([sys.executable, "-c", f"import urllib.request as u; u.urlopen(u.Request("
                              f"'{client}/v3/kv/range', data=b'{{\"key\": \"AA==\"}}'), timeout=2).read()"],
                             capture_output=True)
                if r.returncode == 0:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"etcd did not start: {log.read()[-2000:].decode(errors='replace')}")
                time.sleep(0.2)
            yield f"etcd://{host.addr}:2379"
        finally:
            proc.kill()
            proc.wait(10)
