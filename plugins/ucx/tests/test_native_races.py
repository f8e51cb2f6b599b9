"""Memory safety of kvt_ucx._ucp under misuse and under threads.

Each case that used to crash the process runs in a subprocess (a crash is a
failed test, not a dead test run).  The races loop for a bounded time; on the
binding before these fixes each crashed within it (SIGSEGV) or failed its
assertion, see the cases.  Timing cannot make a race certain, so they are
written to hit it many times per run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

_PRELUDE = """
import os, random, sys, threading, time
import numpy as np
from kvt_ucx import native
ucp = native.load()
CFG = {"NET_DEVICES": "lo"}
SECONDS = float(os.environ.get("RACE_SECONDS", "2.5"))
"""


def _run(body: str, timeout: float = 90) -> str:
    """Run ``body`` in a fresh interpreter; it must exit 0 (a crash is a failure)."""
    code = _PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", UCX_LOG_LEVEL="error")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, (f"exit status {p.returncode}\nstdout: {p.stdout[-2000:]}\n"
                               f"stderr: {p.stderr[-3000:]}")
    return p.stdout


# -- 1: the endpoint, a key or the worker torn down while another thread uses it --------------------------------


def test_transfers_while_the_peer_is_replaced():
    """Public API: one thread transfers to B (256 rows: post releases the GIL)
    while another re-adds B's metadata, which closes the old endpoint and
    keys (UcxBackend._drop): a new version each time, B registering and
    deregistering a buffer in turn (unchanged metadata would keep the
    endpoint; an older version its owner no longer vouches for is refused).
    Every transfer either runs or raises a kvt error."""
    out = _run("""
        from kvt_ucx import UcxBackend
        from kvt.types import Descs, Op
        from kvt.errors import KvtError
        opts = {"timeout": 5.0, "ucx": CFG}
        A, B = UcxBackend("A", opts), UcxBackend("B", opts)
        a, b = np.zeros(1 << 20, np.uint8), np.ones(1 << 20, np.uint8)
        A.register(Descs.from_buffers([a]))
        B.register(Descs.from_buffers([b]))
        A.add_remote(B.local_metadata())
        c, creg = np.ones(4096, np.uint8), None
        N = 256
        pl = A.prep(None, Descs.from_blocks(a.ctypes.data, 2048, np.arange(0, 2 * N, 2)))
        pr = A.prep("B", Descs.from_blocks(b.ctypes.data, 2048, np.arange(0, 2 * N, 2)))
        stop, counts = False, {"posted": 0, "errors": 0}
        def mover():
            while not stop:
                try:
                    A.release(A.transfer(Op.READ, pl, None, pr, None))
                    counts["posted"] += 1
                except KvtError:
                    counts["errors"] += 1
        t = threading.Thread(target=mover)
        t.start()
        try:
            deadline = time.monotonic() + SECONDS
            while time.monotonic() < deadline:
                if creg is None:
                    creg = B.register(Descs.from_buffers([c]))
                else:
                    B.deregister(creg)
                    creg = None
                A.add_remote(B.local_metadata())
        finally:
            stop = True
            t.join()
        h = A.transfer(Op.READ, pl, None, pr, None)  # the last endpoint still works
        while A.check_state(h).pending:
            pass
        assert A.check_state(h).done, A.check_state(h)
        assert (a[:2048] == 1).all()
        A.close(); B.close()
        print("ok", counts)
    """)
    assert "ok" in out


def test_post_while_keys_and_endpoint_close():
    """Raw binding: post() of 256 rows in one thread, RemoteKey.destroy and
    Endpoint.close in another: post raises Error(NOT_CONNECTED) once they are gone."""
    out = _run("""
        w = ucp.Worker(b"a", CFG, 1 << 20, 16, 1 << 24, 0)
        N = 256
        buf = np.zeros(N * 8192, np.uint8)
        mh, packed = w.mem_map(buf.ctypes.data, buf.nbytes)
        addr, base = w.address(), buf.ctypes.data
        local = np.array([[base + 2 * i * 4096, 64] for i in range(N)], np.uint64)
        remote = np.array([[base + (2 * i + 1) * 4096, 64, 0] for i in range(N)], np.uint64)
        gone = 0
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            ep = w.connect(addr, False)
            key = ep.unpack(packed)
            stop = False
            def poster():
                global gone
                while not stop:
                    try:
                        w.post(0, ep, local, None, remote, None, [key], None)
                    except ucp.Error as e:
                        assert e.args[1] == -24, e.args  # UCS_ERR_NOT_CONNECTED
                        gone += 1
                        return
            t = threading.Thread(target=poster)
            t.start()
            time.sleep(random.random() * 0.002)
            key.destroy()
            ep.close()
            stop = True
            t.join()
        w.close()
        print("ok", gone)
    """)
    assert "ok" in out


def test_rkeys_that_close_the_endpoint():
    """rkeys is materialised before anything is checked: a generator that
    closes the endpoint makes post() raise Error (it used to post on it: SIGSEGV)."""
    out = _run("""
        w = ucp.Worker(b"a", CFG, 1 << 20, 16, 1 << 24, 0)
        buf = np.zeros(1 << 16, np.uint8)
        mh, packed = w.mem_map(buf.ctypes.data, buf.nbytes)
        ep = w.connect(w.address(), False)
        key = ep.unpack(packed)
        local = np.array([[buf.ctypes.data, 4096]], np.uint64)
        remote = np.array([[buf.ctypes.data + 8192, 4096, 0]], np.uint64)
        def keys():
            ep.close()
            yield key
        try:
            w.post(0, ep, local, None, remote, None, keys(), None)
        except ucp.Error as e:
            assert e.args[1] == -24, e.args  # UCS_ERR_NOT_CONNECTED
        else:
            raise AssertionError("posted on a closed endpoint")
        w.close()
        print("ok")
    """)
    assert "ok" in out


def test_close_while_other_threads_progress():
    """Worker.close() while two threads are in progress(): they get
    RuntimeError, never a destroyed worker."""
    out = _run("""
        deadline, n = time.monotonic() + SECONDS, 0
        while time.monotonic() < deadline:
            w = ucp.Worker(b"a", CFG, 1 << 20, 16, 1 << 24, 0)
            def spin():
                try:
                    while True:
                        w.progress()
                except RuntimeError:
                    pass
            ts = [threading.Thread(target=spin) for _ in range(2)]
            for t in ts:
                t.start()
            time.sleep(0.001 * (n % 5))
            w.close()
            for t in ts:
                t.join()
            n += 1
        print("ok", n)
    """)
    assert "ok" in out


# -- 2: two threads tearing down one endpoint and its keys ----------------------------------------------------------


def test_concurrent_teardown_of_one_endpoint():
    """Two threads destroy the same keys and close the same endpoint (with its
    second lane) while a split transfer runs on it, so the helper holds the
    second lane's lock and both wait for it: each handle is destroyed once."""
    out = _run("""
        w1 = ucp.Worker(b"a", CFG, 1 << 20, 16, 1 << 24, 2 << 20)  # split on
        w2 = ucp.Worker(b"b", CFG, 1 << 20, 16, 1 << 24, 0)
        S, rows = 64 << 20, 128
        src, dst = np.ones(S, np.uint8), np.zeros(S, np.uint8)
        mh, packed = w2.mem_map(src.ctypes.data, S)
        addr = w2.address()
        local = np.array([[dst.ctypes.data + i * (S // rows), S // rows] for i in range(rows)], np.uint64)
        remote = np.array([[src.ctypes.data + i * (S // rows), S // rows, 0] for i in range(rows)], np.uint64)
        deadline, it = time.monotonic() + SECONDS, 0
        while time.monotonic() < deadline:
            ep = w1.connect(addr, False)
            ep.watch(os.pidfd_open(os.getpid()))  # same host, cma: the second lane (ep1, rkey1)
            keys = [ep.unpack(packed) for _ in range(4)]
            go = threading.Barrier(3)
            def big():
                go.wait()
                try:
                    w1.post(0, ep, local, None, remote, None, keys[:1], None)
                except ucp.Error:
                    pass
            def drop():
                go.wait()
                time.sleep(0.001)
                for k in keys:
                    k.destroy()
                ep.close()
            ts = [threading.Thread(target=big)] + [threading.Thread(target=drop) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert ep.error() != 0 and ep.lanes() == 1  # closed, both lanes
            it += 1
        w1.close(); w2.close()
        print("ok", it)
    """)
    assert "ok" in out


def test_backend_drops_a_peer_once(make_backend):
    """Two threads past one peer's deadline both call _fail -> _drop: the keys,
    endpoint and pidfd of that peer are closed by one of them only."""
    from kvt.errors import TransferTimeout
    from kvt_ucx.backend import _Peer

    closed: list[str] = []

    class Handle:
        def __init__(self, name):
            self.name = name

        def destroy(self):
            closed.append(self.name)

        def close(self):
            closed.append(self.name)

    b = make_backend()
    r, w = os.pipe()
    os.close(w)
    p = _Peer(md=None, regions=None, ep=Handle("ep"), keys=[Handle("k0"), None, Handle("k1")], same_host=True,
              pidfd=r)
    b._drop(p, TransferTimeout("late"))
    b._drop(p, TransferTimeout("late"))
    assert closed == ["k0", "k1", "ep"]
    assert p.pidfd == -1


# -- 3: the caller's index arrays change while post() runs -------------------------------------------------------


def test_index_arrays_changed_during_post():
    """Another thread flips an index out of range and back while post() runs
    (256 rows: without the GIL): post raises ValueError or posts the checked
    pairs, never indexes past the tables."""
    out = _run("""
        w = ucp.Worker(b"a", CFG, 1 << 20, 16, 1 << 24, 0)
        N = 256
        buf = np.zeros(N * 8192, np.uint8)
        mh, packed = w.mem_map(buf.ctypes.data, buf.nbytes)
        ep = w.connect(w.address(), False)
        key = ep.unpack(packed)
        base = buf.ctypes.data
        local = np.array([[base + 2 * i * 4096, 64] for i in range(N)], np.uint64)
        remote = np.array([[base + (2 * i + 1) * 4096, 64, 0] for i in range(N)], np.uint64)
        idx = np.arange(N, dtype=np.int64)
        stop = False
        def flipper():
            while not stop:
                idx[N - 1] = 1 << 40   # far out of range
                idx[N - 1] = N - 1
        t = threading.Thread(target=flipper)
        t.start()
        ok = bad = 0
        deadline = time.monotonic() + SECONDS
        try:
            while time.monotonic() < deadline:
                try:
                    w.post(0, ep, local, idx, remote, idx, [key], None)
                    ok += 1
                except ValueError:
                    bad += 1
        finally:
            stop = True
            t.join()
        w.close()
        print("ok", ok, bad)
    """)
    assert "ok" in out


# -- 4: lengths whose sum wraps ---------------------------------------------------------------------------------


def test_lengths_that_wrap_are_refused():
    """Rows whose lengths sum past 2**64 (a split request's chunk list was sized
    from the wrapped sum: heap overflow), or whose address + length wraps, are
    refused before anything is built or posted."""
    out = _run("""
        w1 = ucp.Worker(b"a", CFG, 1 << 20, 16, 1 << 24, 2 << 20)  # split on
        w2 = ucp.Worker(b"b", CFG, 1 << 20, 16, 1 << 24, 0)
        buf = np.zeros(1 << 16, np.uint8)
        mh, packed = w2.mem_map(buf.ctypes.data, buf.nbytes)
        ep = w1.connect(w2.address(), False)
        ep.watch(os.pidfd_open(os.getpid()))  # the second lane, where it can be had
        key = ep.unpack(packed)
        l1, l2 = 1 << 63, (1 << 63) + (2 << 20)  # l1 + l2 wraps to 2 MiB: split
        local = np.array([[0x10000000, l1], [0x90000000, l2]], np.uint64)
        remote = np.array([[0x20000000, l1, 0], [0xA0000000, l2, 0]], np.uint64)
        wrap = np.array([[(1 << 64) - 4096, 8192]], np.uint64)
        far = np.array([[0x20000000, 8192, 0]], np.uint64)
        for args in [(local, remote), (wrap, far)]:
            try:
                w1.post(0, ep, args[0], None, args[1], None, [key], None)
            except ValueError as e:
                assert "wraps or the lengths overflow" in str(e), e
            else:
                raise AssertionError("posted rows that wrap")
        w1.close(); w2.close()
        print("ok")
    """, timeout=60)
    assert "ok" in out


# -- 5: a Worker whose __init__ failed or never ran -------------------------------------------------------------


def test_failed_init_leaves_fd0_alone():
    """A Worker whose __init__ fails (bad name) used to close fd 0 twice when freed."""
    out = _run("""
        import gc
        r, wr = os.pipe()
        os.dup2(r, 0)
        before = os.fstat(0).st_ino
        for args in [(b"", {}, 1, 1, 1), (b"x" * 2000, {}, 1, 1, 1)]:
            try:
                ucp.Worker(*args)
            except ValueError:
                pass
        gc.collect()
        assert os.fstat(0).st_ino == before, "fd 0 was closed"
        print("ok")
    """)
    assert "ok" in out


def test_uninitialised_worker():
    """Worker.__new__ without __init__: close() leaves fd 0 open, address() and
    the other calls raise instead of handing UCX a NULL worker."""
    out = _run("""
        r, wr = os.pipe()
        os.dup2(r, 0)
        before = os.fstat(0).st_ino
        w = ucp.Worker.__new__(ucp.Worker)
        w.close()
        assert os.fstat(0).st_ino == before, "fd 0 was closed"
        for call in (lambda w: w.address(), lambda w: w.progress(), lambda w: w.connect(b"x" * 64, False),
                     lambda w: w.mem_map(4096, 4096), lambda w: w.take_notifs()):
            w2 = ucp.Worker.__new__(ucp.Worker)
            try:
                call(w2)
            except RuntimeError:
                pass
            else:
                raise AssertionError("an uninitialised Worker was used")
        print("ok")
    """)
    assert "ok" in out
