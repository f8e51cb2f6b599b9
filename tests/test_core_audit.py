"""Regressions from an audit of the core: hostile discovery stores, sandbox
children that hang or meet a busy process, epoch pages that shrink, copy
rows that wrap, hostile tuning variables and timeouts.  Each test failed
before its fix (crash, hang, or a non-kvt exception)."""

from __future__ import annotations

import base64
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import kvt
from kvt import memory, sandbox
from kvt.config import load_config
from kvt.discovery import TcpStore, _PREFIX, open_store
from kvt.epoch import Epoch, EpochWatch
from kvt.errors import ConfigError, DiscoveryError, InvalidArgument, WireError
from kvt_conformance.peer import freeze

KVT_ROOT = str(Path(kvt.__file__).resolve().parent.parent)  # the kvt under test, for child processes


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this kvt (crashes stay there)."""
    path = os.pathsep.join([KVT_ROOT, os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": path, **env})


# -- discovery: a hostile etcd gateway --------------------------------------------------------------

class FakeEtcd:
    """An HTTP server answering every POST as ``mode`` says; counts the paths asked."""

    def __init__(self, mode: str):
        self.mode, self.asked = mode, []
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(c,), daemon=True).start()

    @staticmethod
    def _reply(c: socket.socket, body: bytes) -> None:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    def _handle(self, c: socket.socket) -> None:
        try:
            c.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                data += c.recv(65536)
            path = data.split()[1].decode()
            self.asked.append(path)
            if self.mode == "long header":
                c.sendall(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n{}")
            elif self.mode == "deep reply":
                self._reply(c, b"[" * 100000)
            elif self.mode == "deep record":
                value = base64.b64encode(b"[" * 3000).decode()
                self._reply(c, json.dumps({"kvs": [{"value": value}]}).encode())
            elif self.mode == "trickle":
                body = b"{}" + b" " * 200
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                for byte in body:
                    c.sendall(bytes([byte]))
                    time.sleep(0.3)
            elif self.mode == "infinite ttl":
                self._reply(c, b'{"ID": "7"}' if "grant" in path else
                            b'{"result": {"TTL": Infinity}}' if "keepalive" in path else b"{}")
        except OSError:
            pass
        finally:
            c.close()

    def close(self) -> None:
        self.srv.close()


@pytest.fixture
def fake_etcd():
    servers = []

    def make(mode: str) -> FakeEtcd:
        servers.append(FakeEtcd(mode))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["long header", "deep reply", "deep record"])
def test_hostile_etcd_replies_are_discovery_errors(fake_etcd, mode):
    # were http.client.LineTooLong and RecursionError
    etcd = fake_etcd(mode)
    with pytest.raises(DiscoveryError):
        open_store(f"etcd://127.0.0.1:{etcd.port}").resolve("p", timeout=5)


@pytest.mark.timeout(60)
def test_an_etcd_member_that_trickles_its_reply_is_cut_at_the_timeout(fake_etcd):
    # a socket timeout bounds each read, not the reply: this took 60 s (200 bytes, 0.3 s apart)
    etcd = fake_etcd("trickle")
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError):
        open_store(f"etcd://127.0.0.1:{etcd.port}").resolve("p", timeout=1)
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_lease_renewal_survives_a_reply_it_cannot_read(fake_etcd):
    # "TTL": Infinity raised OverflowError in the keeper thread, which died: no renewal ever again
    etcd = fake_etcd("infinite ttl")
    store = open_store(f"etcd://127.0.0.1:{etcd.port}")
    try:
        store.publish("p", "tcp://10.0.0.1:1", ttl=1)
        deadline = time.monotonic() + 30
        while etcd.asked.count("/v3/lease/keepalive") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert etcd.asked.count("/v3/lease/keepalive") >= 2
        assert store._keeper.is_alive()
    finally:
        store._stop.set()


@pytest.mark.timeout(60)
def test_etcd_urls_that_are_not_host_port_are_config_errors():
    for url in ("etcd://127.0.0.1:notaport", "etcd://127.0.0.1:99999", "etcd://a b:1"):
        with pytest.raises(ConfigError):  # was http.client.InvalidURL at the first call
            open_store(url)


@pytest.fixture
def tcpstore():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TcpStore("127.0.0.1", port, server=True)
    yield store
    store.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw", [b'{"endpoint": "tcp://a:1", "expires": NaN}',
                                 b'{"endpoint": "tcp://a:1", "expires": Infinity}',
                                 b'{"endpoint": "tcp://a:1", "expires": true}',
                                 b"[" * 3000])
def test_records_that_never_expire_or_nest_deeply_are_unreadable(tcpstore, raw):
    # NaN and Infinity never compared as expired (the name resolved forever); deep nesting was RecursionError
    tcpstore._s.set(_PREFIX + "p", raw)
    with pytest.raises(DiscoveryError, match="unreadable record"):
        tcpstore.resolve("p")


@pytest.mark.timeout(60)
def test_publish_checks_ttl_and_endpoint(tcpstore):
    for ttl in (float("inf"), float("nan"), "abc", 1e30):  # inf: OverflowError, or a record that never expires
        with pytest.raises(InvalidArgument):
            tcpstore.publish("p", "tcp://a:1", ttl=ttl)
    with pytest.raises(InvalidArgument):
        tcpstore.publish("p", "not an endpoint")
    assert tcpstore._keeper is None


# -- sandbox ----------------------------------------------------------------------------------------

def probe(settings):
    def check(payload: bytes) -> None:
        pass
    return check


PROBE = f"{__name__}:probe"


@pytest.fixture
def children(monkeypatch):
    monkeypatch.setattr(sandbox, "_children", {})
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), KVT_ROOT,
                                                      os.environ.get("PYTHONPATH", "")]))
    yield
    for child in sandbox._children.values():
        child.proc.kill()
        child.proc.wait()


@pytest.mark.timeout(120)
def test_vet_works_when_the_pipes_are_numbered_past_fd_setsize(children):
    # select() refused fds >= 1024 with ValueError: a busy engine process could vet nothing
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300) if hard == resource.RLIM_INFINITY
                                                else min(hard, max(soft, 1300)), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        sandbox.vet(PROBE, {}, b"fine", "refused")
        (child,) = sandbox._children.values()
        assert child.proc.stdout.fileno() >= 1024
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
def test_a_child_that_stops_reading_cannot_block_vet(children, monkeypatch):
    # the payload was written with a blocking write: a wedged child held vet (and its lock) forever
    monkeypatch.setattr(sandbox, "CHECK_TIMEOUT", 1.0)
    sandbox.vet(PROBE, {}, b"fine", "refused")
    (child,) = sandbox._children.values()
    freeze(child.proc.pid)  # every thread stopped: a bare SIGSTOP lets the child read on for a moment
    t0 = time.monotonic()
    with pytest.raises(WireError, match="^refused$"):
        sandbox.vet(PROBE, {}, b"x" * (4 << 20), "refused")
    assert time.monotonic() - t0 < 30
    assert child.proc.poll() is not None and not sandbox._children


# -- epoch ------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_an_epoch_page_that_can_shrink_is_not_watched():
    # a peer that truncated its page after we mapped it killed us with SIGBUS at the next check
    r = run_py("""
        import mmap, os
        from kvt.epoch import EpochWatch
        fd = os.memfd_create("kvt-epoch", os.MFD_CLOEXEC)
        os.ftruncate(fd, mmap.PAGESIZE)
        w = EpochWatch.open(os.getpid(), fd, 0)
        if w is not None:
            os.ftruncate(fd, 0)
            print("stale", w.stale)
        print("refused" if w is None else "watched")
    """)
    assert r.returncode == 0, f"died with {r.returncode}: {r.stderr[-300:]}"
    assert r.stdout.split()[-1] == "refused"


@pytest.mark.timeout(60)
def test_our_epoch_page_cannot_shrink_and_peers_still_watch_it():
    e = Epoch()
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(e.fd, 0)
        w = EpochWatch.open(os.getpid(), e.fd, e.value)
        assert w is not None and not w.stale
        e.bump()
        assert w.stale
        w.close()
        assert EpochWatch.open(os.getpid(), "3", 0) is None and EpochWatch.open(None, e.fd, 0) is None
    finally:
        e.close()


# -- memcopy ----------------------------------------------------------------------------------------

ENGINES = ["native", "python"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ENGINES)
def test_rows_whose_address_plus_length_wraps_are_refused(engine):
    # they reached memmove: SIGSEGV
    r = run_py("""
        import numpy as np
        from kvt import memcopy
        top = np.array([2**64 - 16], np.uint64)
        for call in (lambda: memcopy.copy(top, top, 64),
                     lambda: memcopy.copy_indexed(top, np.array([0]), top, np.array([0]), 64)):
            try:
                call()
                print("copied?!")
            except ValueError as e:
                print("refused", e)
        a = np.zeros(64, np.uint8); b = np.arange(64, dtype=np.uint8)
        memcopy.copy(np.array([a.ctypes.data], np.uint64), np.array([b.ctypes.data], np.uint64), 64)
        print("ok" if (a == b).all() else "wrong")
    """, KVT_NATIVE="1" if engine == "native" else "0")
    assert r.returncode == 0, f"died with {r.returncode}: {r.stderr[-300:]}"
    assert r.stdout.count("refused") == 2 and r.stdout.split()[-1] == "ok", r.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ENGINES)
def test_copy_indexed_totals_past_2_63_are_not_read_as_outcomes(engine):
    # the count was cast to a signed long long: 2**64 - 1 bytes read as STALE (-1), after copying them
    r = run_py("""
        import numpy as np
        from kvt import memcopy
        t = np.array([4096, 4096], np.uint64)
        try:
            memcopy.copy_indexed(t, np.array([0, 1]), t, np.array([0, 1]), np.array([2**63, 2**63 - 1], np.uint64))
            print("copied?!")
        except OverflowError:
            print("refused")
        print(memcopy.copy_indexed(t, np.array([0, 1]), t, np.array([0, 1]), np.array([2**63, 2**63 - 1], np.uint64),
                                   max_bytes=1 << 20))
    """, KVT_NATIVE="1" if engine == "native" else "0")
    assert r.returncode == 0, f"died with {r.returncode}: {r.stderr[-300:]}"
    assert r.stdout.split() == ["refused", "-2"]  # TOO_BIG still wins when max_bytes is set


@pytest.mark.timeout(120)
@pytest.mark.parametrize("var,value", [("KVT_COPY_THREADS", "99999999999"), ("KVT_COPY_THREADS", "many"),
                                       ("KVT_COPY_THREADS", "nan"), ("KVT_COPY_SPLIT_MIB", "nan"),
                                       ("KVT_COPY_SPLIT_MIB", "inf"), ("KVT_COPY_SPIN_US", "nan"),
                                       ("KVT_COPY_SPIN_US", "-5"), ("KVT_COPY_SPIN_US", "1e30")])
def test_hostile_tuning_variables_do_not_break_import_or_copies(var, value):
    # were ValueError / OverflowError at import, or OverflowError from every native copy
    r = run_py("""
        import numpy as np
        from kvt import memcopy
        a = np.zeros(1 << 20, np.uint8); b = np.ones(1 << 20, np.uint8)
        memcopy.copy(np.array([a.ctypes.data], np.uint64), np.array([b.ctypes.data], np.uint64), 1 << 20)
        assert 1 <= memcopy.THREADS <= 16 and memcopy.SPLIT_BYTES >= 0 and 0 <= memcopy.SPIN_US <= 10_000
        print("ok" if a.all() else "wrong")
    """, **{var: value})
    assert r.returncode == 0 and r.stdout.split()[-1] == "ok", r.stderr[-500:]


# -- memory -----------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", [(3, 6148914691236517206), (2**32, 2**32), (2**70,), ("a",)])
def test_shapes_whose_size_wraps_int64_are_invalid_arguments(shape):
    # np.prod in int64 wrapped (to 2 or 0 bytes), then reshape raised ValueError; 2**70 raised OverflowError
    with pytest.raises(InvalidArgument):
        memory.empty(shape)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["Hugepagesize:       0 kB\nHugePages_Free: 4\n", "HugePages_Free:\n"])
def test_odd_meminfo_does_not_break_page_policy(tmp_path, monkeypatch, text):
    # were ZeroDivisionError and IndexError
    (tmp_path / "meminfo").write_text(text)
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    kind, _ = memory.page_policy(1 << 20)
    assert kind in ("hugetlb", "thp", "4k")
    assert memory.empty(4096).nbytes == 4096


# -- config -----------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_timeouts_too_large_to_wait_for_are_config_errors(tmp_path):
    # accepted, then OverflowError in the first wait (Agent.connect with handshake_timeout=1e300)
    for kw in ({"transfer_timeout": float("inf")}, {"handshake_timeout": 1e300},
               {"options": {"timeout": float("inf")}}, {"options": {"timeout": 10**400}}):
        with pytest.raises(ConfigError):
            load_config(env={}, **kw)
    (tmp_path / "kvt.toml").write_text("transfer_timeout = inf\n")
    with pytest.raises(ConfigError, match="transfer_timeout"):
        load_config(env={}, path=tmp_path / "kvt.toml")
    assert load_config(env={}, transfer_timeout=86400.0).transfer_timeout == 86400.0


# -- discovery: a renewal in flight ------------------------------------------------------------------

class _SlowStore:
    """An in-memory store whose renewals can be held mid-call (a slow store)."""

    def __new__(cls):
        from kvt.discovery import Store

        class Slow(Store):
            def __init__(self):
                super().__init__()
                self.records, self.in_renew, self.release = {}, threading.Event(), threading.Event()

            def _put(self, name, endpoint, ttl):
                self.records[name] = endpoint

            def _get(self, name, timeout):
                return self.records.get(name)

            def _renew(self, name, lease, endpoint, ttl):
                self.in_renew.set()
                assert self.release.wait(30)
                self.records[name] = endpoint  # as TcpStore rewrites its record

            def _drop(self, name, lease):
                self.records.pop(name, None)
        return Slow()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["withdraw", "publish anew"])
def test_a_renewal_in_flight_does_not_undo_a_withdraw_or_a_new_publish(then):
    # the keeper renewed from a snapshot: a name withdrawn meanwhile was written back (it resolved
    # again), and a name re-published meanwhile got its old endpoint (and, on etcd, its old lease) back
    store = _SlowStore()
    store.publish("p", "tcp://10.0.0.1:1", ttl=1)
    assert store.in_renew.wait(30)
    if then == "withdraw":
        act = threading.Thread(target=store.withdraw, args=("p",))
    else:
        act = threading.Thread(target=store.publish, args=("p", "tcp://10.0.0.2:2", 1))
    act.start()
    act.join(0.5)  # now waits for the renewal (it used to go ahead at once)
    store.release.set()
    act.join(30)
    store._stop.set()
    store._keeper.join(30)
    assert store.records.get("p") == (None if then == "withdraw" else "tcp://10.0.0.2:2")


@pytest.mark.timeout(120)
def test_an_endless_auth_key_file_is_a_config_error():
    # KVT_AUTH_KEY_FILE=/dev/zero was read until memory ran out (MemoryError under a 3 GiB limit)
    r = run_py("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        from kvt.config import load_config
        from kvt.errors import ConfigError
        try:
            load_config(env={"KVT_AUTH_KEY_FILE": "/dev/zero"})
        except ConfigError as e:
            print("refused", "auth_key_file" in str(e))
    """)
    assert r.stdout.split() == ["refused", "True"], r.stderr[-300:]


@pytest.mark.timeout(60)
def test_shared_segments_cannot_shrink_under_a_peer_that_mapped_them():
    # a segment's owner (or anyone holding its fd) could truncate it: a same-host peer's copy from
    # the mapping then died of SIGBUS.  Sealed now; the peer side (kvt_host.memops) can require it.
    import fcntl
    a = memory.empty(1 << 16)
    (fd,) = [fd for base, (fd, size) in memory._segments.items() if base == a.ctypes.data]
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not __import__("shutil").which("etcd"), reason="no etcd on PATH")
def test_the_etcd_client_against_a_real_etcd(tmp_path):
    # the gateway client is plain http.client now (a deadline per call, no proxies, no redirects)
    from kvt.errors import UnknownPeer

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    client, peer = port(), port()
    etcd = subprocess.Popen(["etcd", "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        store = open_store(f"etcd://127.0.0.1:{client}")
        deadline = time.monotonic() + 30
        while True:
            try:
                store.publish("p", "tcp://10.1.2.3:4", ttl=1)
                break
            except DiscoveryError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        time.sleep(2.5)  # past the ttl: only renewals keep it
        assert store.resolve("p") == "tcp://10.1.2.3:4"
        store.withdraw("p")
        with pytest.raises(UnknownPeer):
            store.resolve("p")
        store.close()
    finally:
        etcd.kill()
        etcd.wait()
