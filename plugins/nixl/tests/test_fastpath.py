"""The nixl backend's post path in C (kvt_nixl/_fastpath.c): its common
case stays in C, and moves the right bytes (int64 ids go to NIXL through
int32 scratch arrays); every other case reaches the Python path, whose
checks and errors it keeps.  The rest of the suite runs on whichever path
is in use (``KVT_NATIVE=0``: the Python one)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from kvt.errors import InvalidArgument, InvalidHandle, RemoteRejected
from kvt.types import Descs, Op

import kvt_nixl.backend as backend_mod
from kvt_nixl.backend import NixlBackend

pytestmark = pytest.mark.timeout(120)

BLOCK, N = 256, 64
native = pytest.mark.skipif(backend_mod._fastpath is None, reason="the C post path is not in use")


def test_native_post_path_is_in_use_unless_disabled():
    """A build that silently lost the extension would pass every other test on the twin."""
    assert (backend_mod._fastpath is None) == (os.environ.get("KVT_NATIVE", "1") == "0")
    assert backend_mod.NixlBackend.post_path.startswith("python (" if backend_mod._fastpath is None else "native (")


@pytest.fixture
def pair(make_backend):
    """(backend, its buffer, local prep, remote prep, the target's buffer): blocks of BLOCK bytes,
    block i of the target filled with i."""
    b, t = make_backend(), make_backend("target")
    buf = np.zeros((N, BLOCK), np.uint8)
    tbuf = np.repeat(np.arange(N, dtype=np.uint8)[:, None], BLOCK, axis=1)
    b.register(Descs.from_buffers([buf]))
    t.register(Descs.from_buffers([tbuf]))
    name = b.add_remote(t.local_metadata())
    lp = b.prep(None, Descs.from_blocks(buf.ctypes.data, BLOCK, range(N)))
    rp = b.prep(name, Descs.from_blocks(tbuf.ctypes.data, BLOCK, range(N)))
    return b, buf, lp, rp, tbuf


@pytest.fixture
def python_calls(monkeypatch):
    """Every call that reached NixlBackend._transfer or _check_state (the Python path)."""
    calls = []
    for name in ("_transfer", "_check_state"):
        real = getattr(NixlBackend, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(self, *args, **kw)

        monkeypatch.setattr(NixlBackend, name, counted)
    return calls


def _read(b, lp, li, rp, ri):
    h = b.transfer(Op.READ, lp, li, rp, ri)
    for _ in range(100_000):
        s = b.check_state(h)
        if not s.pending:
            break
    b.release(h)
    if s.failed:
        raise s.cause
    assert s.done


@native
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_the_common_case_stays_in_c_and_moves_the_right_blocks(pair, python_calls, dtype):
    b, buf, lp, rp, tbuf = pair
    for n in (1, 2, 16):  # (int64: every scratch size up to _FEW is one of 1..16)
        remote = np.arange(n, dtype=dtype)[::-1] * 3 + 1
        local = np.arange(n, dtype=dtype) + n
        buf[:] = 0
        _read(b, lp, local, rp, remote)
        assert (buf[local.astype(np.int64), 0] == remote.astype(np.uint8)).all()
        assert (buf[local.astype(np.int64)] == tbuf[remote.astype(np.int64)]).all()
        assert np.count_nonzero(buf) == n * BLOCK
    assert "_transfer" not in python_calls


@native
def test_a_transfer_finished_within_its_post_is_polled_in_c(pair, python_calls):
    from kvt_nixl.backend import _Xfer

    b, buf, lp, rp, tbuf = pair
    for _ in range(20):
        del python_calls[:]
        h = b.transfer(Op.READ, lp, np.array([1], np.int32), rp, np.array([2], np.int32))
        finished = b._xfers[h].__class__ is not _Xfer
        assert b.check_state(h).done or not finished
        b.release(h)
        if finished:
            break
    else:
        pytest.skip("NIXL finished none of 20 one-block READs within its post here")
    assert python_calls == []


@native
def test_int64_ids_posted_from_threads_at_once_land_where_asked(pair):
    """The scratch arrays are shared: filled and read by NIXL under the lock
    only, so posts from several threads never see each other's ids."""
    b, buf, lp, rp, tbuf = pair
    errors = []

    def worker(k):
        try:
            for i in range(200):
                block = (k * 7 + i) % N
                _read(b, lp, np.array([k], np.int64), rp, np.array([block], np.int64))
                assert buf[k, 0] == block, (k, buf[k, 0], block)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]


@native
@pytest.mark.parametrize("case", ["17 int64 ids", "a list", "None", "2-D", "notification", "keywords",
                                  "int16", "strided"])
def test_other_index_kinds_and_calls_take_the_python_path(pair, python_calls, case):
    b, buf, lp, rp, tbuf = pair
    ids, kw = np.array([5], np.int64), {}
    li = ri = ids
    if case == "17 int64 ids":
        li = ri = np.arange(17, dtype=np.int64)
    elif case == "a list":
        li = ri = [5]
    elif case == "None":
        li = ri = None
    elif case == "2-D":
        li = ri = np.array([[5]], np.int32)
    elif case == "notification":
        kw = {"notif": b"hello"}
    elif case == "keywords":
        kw = {"remote_idx": ri}
    elif case == "int16":
        li = ri = np.array([5], np.int16)
    elif case == "strided":
        li = ri = np.arange(10, dtype=np.int32)[::5]
    args = [Op.READ, lp, li, rp] + ([] if case == "keywords" else [ri])
    try:
        h = b.transfer(*args, **kw)
    except InvalidArgument:
        assert case == "2-D"
    else:
        b.release(h)
    assert python_calls[:1] == ["_transfer"]


@native
@pytest.mark.parametrize("bad", [[-1], [N], [2**31], [2**40], [-(2**31) - 1]])
def test_ids_out_of_range_are_refused_as_on_the_python_path(pair, bad):
    """Out of the list, or too wide for NIXL's int: InvalidArgument naming
    them, never a wrapped id (2**32 + 5 read as block 5)."""
    b, buf, lp, rp, tbuf = pair
    with pytest.raises(InvalidArgument):
        b.transfer(Op.READ, lp, np.array([0], np.int64), rp, np.array(bad, np.int64))
    with pytest.raises(InvalidArgument):
        b.transfer(Op.READ, lp, np.array(bad, np.int64), rp, np.array([0], np.int64))
    assert not buf.any()


@native
def test_a_peer_that_deregistered_is_refused_on_the_fast_path_too(pair, python_calls, monkeypatch):
    """A same-host peer's epoch moved: RemoteRejected (worded by the Python path)."""
    b, buf, lp, rp, tbuf = pair

    class Moved:  # what the C path reads: the counter's address and the value the metadata carried
        counter = np.array([2], np.uint64)
        address, seen = counter.ctypes.data, 1

    monkeypatch.setattr(b._preps[rp], "epoch", Moved())
    monkeypatch.setattr(backend_mod, "_stale", lambda watch: True)
    with pytest.raises(RemoteRejected):
        b.transfer(Op.READ, lp, np.array([0], np.int32), rp, np.array([0], np.int32))
    assert python_calls == ["_transfer"]
    Moved.seen = 2  # unmoved: the fast path posts
    monkeypatch.setattr(backend_mod, "_stale", lambda watch: False)
    _read(b, lp, np.array([0], np.int32), rp, np.array([1], np.int32))
    assert python_calls.count("_transfer") == 1 and buf[0, 0] == 1


@native
def test_check_state_of_unknown_handles_is_the_python_paths(pair, python_calls):
    b, buf, lp, rp, tbuf = pair
    for h in (12345, "x", [1]):
        with pytest.raises(InvalidHandle):
            b.check_state(h)
    assert python_calls == ["_check_state"] * 3
