"""The host backend's same-host post in C (kvt_host/_fastpath.c): its common
case stays in C, answers ``SETTLED`` and moves the right bytes; a copy whose
outcome is anything but "copied, the owner alive" goes to
``HostBackend._after_copy`` (still holding the lane), and every other request
to the Python path, whose checks and errors it keeps.  The rest of the suite
runs on whichever path is in use (``KVT_NATIVE=0``: the Python one); the
races against ``remove_remote`` and ``close`` are test_host_races.py's."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from kvt import Descs, Op, memcopy, memory
from kvt.errors import InvalidArgument, KvtError, PeerDisconnected, RemoteRejected
from kvt.types import SETTLED

import kvt_host.backend as backend_mod
from kvt_host.backend import HostBackend

pytestmark = pytest.mark.timeout(120)

BLOCK, N = 256, 64
native = pytest.mark.skipif(backend_mod._fastpath is None, reason="the C post path is not in use")


def test_native_post_path_is_in_use_unless_disabled():
    """A build that silently lost the extension would pass every other test on the twin."""
    assert (backend_mod._fastpath is None) == (os.environ.get("KVT_NATIVE", "1") == "0")
    assert HostBackend.post_path.startswith("python (" if backend_mod._fastpath is None else "native (")  # kvt backends


def _blocks(buf: np.ndarray, block: int = BLOCK) -> Descs:
    return Descs.from_blocks(buf.ctypes.data, block, range(buf.nbytes // block))


@pytest.fixture
def pair():
    """(backend, its buffer, its prep, a second local buffer and its prep, the peer's buffer and prep):
    block i of both sources holds i; the peer's memory is a shared segment (the one-call path's)."""
    t, b = HostBackend("target", {"timeout": 5}), HostBackend("me", {"timeout": 5})
    try:
        tbuf = memory.empty((N, BLOCK))
        tbuf[:] = np.arange(N, dtype=np.uint8)[:, None]
        other = tbuf.copy()
        buf = np.zeros((N, BLOCK), np.uint8)
        t.register(Descs.from_buffers([tbuf]))
        b.register(Descs.from_buffers([buf, other]))
        name = b.add_remote(t.local_metadata())
        yield b, buf, b.prep(None, _blocks(buf)), other, b.prep(None, _blocks(other)), tbuf, b.prep(name, _blocks(tbuf))
    finally:
        b.close()
        t.close()


@pytest.fixture
def python_calls(monkeypatch):
    """Every call that reached HostBackend._transfer (the Python path) or _after_copy."""
    calls = []
    for name in ("_transfer", "_after_copy"):
        real = getattr(HostBackend, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(self, *args, **kw)

        monkeypatch.setattr(HostBackend, name, counted)
    return calls


@pytest.fixture
def copy_outcome():
    """Make the C path's copy engine answer what the test sets (``outcome[0]``: an int, or an exception
    to raise) without copying; kvt's own copy_indexed again afterwards."""
    outcome = [0]

    def fake(*args):
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    backend_mod._fastpath.setup(Op.READ, Op.WRITE, np.ndarray, fake, SETTLED, memcopy.THREADS)
    yield outcome
    backend_mod._fastpath.setup(Op.READ, Op.WRITE, np.ndarray, memcopy.copy_indexed, SETTLED, memcopy.THREADS)


def _settle(b: HostBackend, h) -> None:
    state = b.wait(h, 10)
    b.release(h)
    if state.failed:
        raise state.cause
    assert state.done


@native
@pytest.mark.parametrize("remote", ["peer", "local"])
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_the_common_case_stays_in_c_and_moves_the_right_blocks(pair, python_calls, op, remote):
    b, buf, lp, other, op_, tbuf, rp = pair
    src, rprep = (tbuf, rp) if remote == "peer" else (other, op_)
    for n in (1, 3, N):
        far = (np.arange(n, dtype=np.int64)[::-1] * 7 + 1) % N
        near = np.arange(n, dtype=np.int64)
        buf[:] = 0
        if op is Op.WRITE:
            buf[near] = np.arange(n, dtype=np.uint8)[:, None] + 100
            want = buf[near].copy()
        assert b.transfer(op, lp, near, rprep, far) is SETTLED
        if op is Op.READ:
            assert (buf[near] == src[far]).all() and np.count_nonzero(buf) == n * BLOCK - (0 in far) * BLOCK
        else:
            assert (src[far] == want).all()
            src[:] = np.arange(N, dtype=np.uint8)[:, None]
    assert python_calls == []


REFUSED = ("out of range", "two lengths", "peer failed", "peer unloaded", "peer removed")


@native
@pytest.mark.parametrize("case", ["notification", "keywords", "a list", "int32", "out of range", "two lengths",
                                  "lane busy", "work queued", "mappings moved", "peer failed", "peer unloaded", "peer removed"])
def test_other_requests_take_the_python_path(pair, python_calls, monkeypatch, case):
    b, buf, lp, other, op_, tbuf, rp = pair
    li = ri = np.array([5], np.int64)
    args, kw = [Op.READ, lp, li, rp, ri], {}
    release = threading.Event()
    if case == "notification":
        kw = {"notif": b"hello"}
    elif case == "keywords":
        args, kw = args[:4], {"remote_idx": ri}
    elif case == "a list":
        args[2] = args[4] = [5]
    elif case == "int32":
        args[2] = args[4] = np.array([5], np.int32)
    elif case == "out of range":
        args[4] = np.array([N], np.int64)
    elif case == "two lengths":  # one table of BLOCK-byte rows, one of 2 x BLOCK
        args[3] = b.prep(None, _blocks(other, 2 * BLOCK))
    elif case == "lane busy":
        b._peers["target"].lane.submit(release.wait, 10)
    elif case == "work queued":  # counted, not yet running: a caller must not run ahead of it
        monkeypatch.setattr(b._peers["target"].lane, "_busy", 1)
    elif case == "mappings moved":  # the prep's addresses belong to an older mapping of the peer's segments
        monkeypatch.setattr(b._peers["target"], "gen", b._peers["target"].gen + 1)
    elif case == "peer failed":
        monkeypatch.setattr(b._peers["target"], "failed", PeerDisconnected("it stopped answering"))
    elif case == "peer unloaded":  # remove_remote between taking it out of the table and closing it
        monkeypatch.delitem(b._peers, "target")
    elif case == "peer removed":
        b.remove_remote("target")
    try:
        h = b.transfer(*args, **kw)
        release.set()
        _settle(b, h)
    except (InvalidArgument, PeerDisconnected, KvtError) as e:
        assert case in REFUSED, e
        assert not buf.any()
    else:
        assert case not in REFUSED
        assert (buf[5] == 5).all() and np.count_nonzero(buf) == BLOCK
    finally:
        release.set()
    assert python_calls[:1] == ["_transfer"]


@native
@pytest.mark.parametrize("outcome", ["stale", "too big", "an IndexError"])
def test_a_copy_that_moved_nothing_hands_the_request_to_the_python_path(pair, python_calls, copy_outcome, outcome):
    """The Python path then asks kvt's copy engine again (this one copies)."""
    b, buf, lp, other, op_, tbuf, rp = pair
    copy_outcome[0] = {"stale": memcopy.STALE, "too big": memcopy.TOO_BIG, "an IndexError": IndexError("x")}[outcome]
    h = b.transfer(Op.READ, lp, np.array([1], np.int64), rp, np.array([2], np.int64))
    _settle(b, h)
    assert (buf[1] == 2).all()
    assert python_calls == (["_transfer"] if outcome == "an IndexError" else ["_after_copy", "_transfer"])
    assert b._peers["target"].lane.enter()  # the C path left the lane
    b._peers["target"].lane.leave()


@native
@pytest.mark.parametrize("outcome", ["dead", "stale after"])
def test_a_copy_that_does_not_count_is_a_failed_transfer(pair, python_calls, copy_outcome, outcome):
    b, buf, lp, other, op_, tbuf, rp = pair
    copy_outcome[0] = memcopy.DEAD if outcome == "dead" else memcopy.STALE_AFTER
    h = b.transfer(Op.READ, lp, np.array([1], np.int64), rp, np.array([2], np.int64))
    assert h is not SETTLED
    with pytest.raises(PeerDisconnected if outcome == "dead" else RemoteRejected):
        _settle(b, h)
    assert python_calls == ["_after_copy"]


@native
def test_a_copy_whose_owner_the_engine_could_not_watch_asks_the_peer(pair, python_calls, monkeypatch):
    """No pidfd and no liveness word: the copy counts once ``_Peer.alive`` says so (in Python)."""
    b, buf, lp, other, op_, tbuf, rp = pair
    peer = b._peers["target"]
    monkeypatch.setattr(peer, "_pidfd", None)
    monkeypatch.setattr(peer.epoch, "alive", 0)
    asked = []
    monkeypatch.setattr(peer, "alive", lambda: asked.append(1) or True)
    assert b.transfer(Op.READ, lp, np.array([1], np.int64), rp, np.array([2], np.int64)) is SETTLED
    assert (buf[1] == 2).all() and asked == [1] and python_calls == ["_after_copy"]


@native
def test_a_request_above_inline_bytes_goes_to_the_worker_without_a_copy_call_in_c(pair, python_calls, copy_outcome):
    b, buf, lp, other, op_, tbuf, rp = pair
    b.inline_bytes = BLOCK
    copy_outcome[0] = BLOCK  # one block: at the limit, copied in C
    assert b.transfer(Op.READ, lp, np.array([1], np.int64), rp, np.array([2], np.int64)) is SETTLED
    assert python_calls == []
    copy_outcome[0] = AssertionError("the C path asked the copy engine about a request above inline_bytes")
    _settle(b, b.transfer(Op.READ, lp, np.array([1, 3], np.int64), rp, np.array([2, 4], np.int64)))
    assert (buf[1] == 2).all() and (buf[3] == 4).all() and python_calls[:1] == ["_transfer"]
