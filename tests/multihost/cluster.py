"""Kvt agents on test hosts, as the tests drive them: ``Node`` (a node.py
process in a network namespace), backend availability, shared constants."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netns import Host, unavailable

NODE = str(Path(__file__).with_name("node.py"))
BACKENDS = ["host", "nixl", "ucx"]
NUM_BLOCKS, BLOCK = 32, 16384
#: inside the namespaces there is no shared memory transport to prefer: UCX over the veth
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_WARN_UNUSED_ENV_VARS": "n"}

_why = None


def hosts_unavailable() -> str | None:
    """Why test hosts cannot be made here (asked once), or None."""
    global _why
    if _why is None:
        _why = unavailable() or ""
    return _why or None


def backend_usable(name: str) -> str | None:
    """Why ``name`` cannot run here, or None.  Asked in a child process: this
    one must not load a plugin's native libraries (nixl's and ucx's libucx clash)."""
    probe = ("import sys; from kvt import KvtError; from kvt.registry import probe\n"
             "try: a = probe(sys.argv[1]).availability; print('' if a.usable else a.reason)\n"
             "except KvtError as e: print(e)")
    r = subprocess.run([sys.executable, "-c", probe, name], capture_output=True, text=True, timeout=120)
    return (r.stdout.strip() or None) if r.returncode == 0 else f"probe failed: {r.stderr[-500:]}"


class NodeFailure(AssertionError):
    pass


class Node:
    """A kvt agent process on a test host (tests/multihost/node.py)."""

    def __init__(self, host: Host, name: str, backend: str, salt: int = 1, *, port: int = 0,
                 timeout: float = 5.0, options: dict | None = None, env: dict | None = None,
                 publish: str | None = None, ttl: float | None = None, start_timeout: float = 60.0):
        self.host, self.name, self.backend = host, name, backend
        opts = {"timeout": timeout}
        if backend == "host":
            opts["listen_host"] = host.addr
        opts.update(options or {})
        spec = {"name": name, "backend": backend, "options": opts, "addr": host.addr, "port": port,
                "blocks": NUM_BLOCKS, "block": BLOCK, "salt": salt, "publish": publish, "ttl": ttl}
        self._err = tempfile.TemporaryFile()
        self.proc = host.popen([sys.executable, NODE, json.dumps(spec)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._err,
                               env={**os.environ, **UCX_ENV, **(env or {})})
        self._buf = b""
        try:
            hello = self._line(start_timeout)
        except BaseException:
            self.kill()
            raise
        self.endpoint = hello["endpoint"]

    def _line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise NodeFailure(f"node {self.name} did not answer within {timeout:g}s{self.stderr()}")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise NodeFailure(f"node {self.name} exited ({self.proc.wait(5)}){self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stderr(self) -> str:
        self._err.seek(0)
        tail = self._err.read()[-3000:].decode(errors="replace")
        return f"; its stderr:\n{tail}" if tail else ""

    def call(self, cmd: str, timeout: float = 60.0, **kw) -> dict:
        self.proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        return self._line(timeout)

    def read(self, peer: str, local, remote, salt: int, **kw) -> dict:
        return self.call("read", peer=peer, local=list(local), remote=list(remote), salt=salt, **kw)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the node leaves its loop and closes its agent
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def skip_unless_required(reason: str) -> None:
    """Skip with ``reason``; fail instead under ``KVT_REQUIRE_HOSTS=1`` (set by
    .ci/run), so CI cannot pass by skipping every multi-host test."""
    if os.environ.get("KVT_REQUIRE_HOSTS") == "1":
        pytest.fail(f"KVT_REQUIRE_HOSTS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def need_backend(name: str) -> None:
    if why := backend_usable(name):
        skip_unless_required(f"backend {name} unusable here: {why}")
