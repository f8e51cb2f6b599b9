"""The conformance suite's remote cases with the peer on another test host:
the suite runs in one network namespace, its peer processes in another."""

from __future__ import annotations

import json
import os
import sys

import pytest

from cluster import BACKENDS, UCX_ENV, need_backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_remote_cases_across_hosts(net, backend, tmp_path):
    need_backend(backend)
    a, b = net.hosts
    local = {"listen_host": a.addr} if backend == "host" else {}
    peer = {"listen_host": b.addr} if backend == "host" else {}
    env = {**os.environ, **UCX_ENV, "KVT_CONFORMANCE_PEER_NETNS": b.ns, "KVT_CONFORMANCE_PEER_HOST": b.addr,
           "KVT_CONFORMANCE_PEER_OPTIONS": json.dumps(peer)}
    report = tmp_path / "report.json"
    r = a.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "kvt_conformance",
               f"--kvt-backend={backend}", f"--kvt-options={json.dumps({'timeout': 5, **local})}",
               f"--kvt-report={report}", "-k", "remote", "--timeout=300"],
              timeout=540, env=env, capture_output=True, text=True)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "failed" not in r.stdout, tail
    print(r.stdout.strip().splitlines()[-1])
