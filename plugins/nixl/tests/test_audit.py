"""Races between the verbs, made deterministic, and handles that are not handles.

Each race pauses one verb at the point where it has read NIXL handles (or a
transfer record) but not yet used them, runs the other verb, then lets the
first go on.  NIXL's transfer-handle calls are wrapped by a spy that records
(and does not forward) any call on a handle already freed, so a double free
shows as a failed assertion rather than as heap corruption."""

from __future__ import annotations

import linecache
import sys
import threading

import numpy as np
import pytest
from kvt.errors import ClosedError, InvalidDescriptor, InvalidHandle, TransferTimeout, UnknownPeer
from kvt.types import Descs, Op, XferState

pytestmark = pytest.mark.timeout(120)

BLOCK, N = 4096, 8


class _GatedIdx(np.ndarray):
    """int32 rows whose first ``.dtype`` read (in ``transfer``, after it read
    its prepped handles) signals ``entered`` and waits for ``go``."""

    def __new__(cls, rows):
        o = np.asarray(rows, np.int32).view(cls)
        o.entered, o.go, o.first = threading.Event(), threading.Event(), [True]
        return o

    def __array_finalize__(self, obj):
        pass

    @property
    def dtype(self):
        first = getattr(self, "first", None)
        if first and first[0]:
            first[0] = False
            self.entered.set()
            self.go.wait(20)
        return np.ndarray.dtype.__get__(self)


class _GatedInt(int):
    """A handle whose first hash (a verb's table lookup) signals and waits."""

    def __new__(cls, v):
        o = int.__new__(cls, v)
        o.entered, o.go, o.first = threading.Event(), threading.Event(), [True]
        return o

    def __hash__(self):
        if self.first[0]:
            self.first[0] = False
            self.entered.set()
            self.go.wait(20)
        return int.__hash__(self)

    def __eq__(self, other):
        return int(self) == other


class _Spy:
    def __init__(self, b, in_progress=False):
        self.freed, self.bad = set(), []
        free, status = b._free, b._status

        def spy_free(h):
            if h in self.freed:
                self.bad.append(("double free", h))
                raise RuntimeError("double free (spy)")
            r = free(h)
            self.freed.add(h)
            return r

        def spy_status(h):
            if h in self.freed:
                self.bad.append(("status after free", h))
                raise RuntimeError("use after free (spy)")
            return b._inprog if in_progress else status(h)

        make = b._make

        def spy_make(*args):
            h = make(*args)
            self.freed.discard(h)  # NIXL reuses a freed handle's address
            return h

        b._free, b._status, b._make = spy_free, spy_status, spy_make


def _thread(fn):
    out = {}

    def body():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th, out


def _local(make_backend):
    b = make_backend()
    buf = np.zeros((N, BLOCK), np.uint8)
    b.register(Descs.from_buffers([buf]))
    lp = b.prep(None, Descs.from_blocks(buf.ctypes.data, BLOCK, range(N)))
    return b, buf, lp


def _pair(make_backend):
    b, buf, lp = _local(make_backend)
    t = make_backend("target")
    tbuf = np.full((N, BLOCK), 7, np.uint8)
    t.register(Descs.from_buffers([tbuf]))
    name = b.add_remote(t.local_metadata())
    rp = b.prep(name, Descs.from_blocks(tbuf.ctypes.data, BLOCK, range(N)))
    return b, buf, lp, t, tbuf, name, rp


def _in_flight(b, h, peer):
    """Turn transfer ``h`` (same-host copies finish within their post) into a
    record of one still in progress around the same NIXL handle."""
    from kvt_nixl.backend import _Xfer

    x = b._xfers[h]
    if x.__class__ is not _Xfer:
        x = b._xfers[h] = _Xfer(x, peer)
        x.deadline = float("inf")
    return x


def test_transfer_racing_close_is_closed_error(make_backend):
    b, buf, lp = _local(make_backend)
    idx = _GatedIdx(range(N))
    th, out = _thread(lambda: b.transfer(Op.READ, lp, idx, lp, np.arange(N, dtype=np.int32)))
    assert idx.entered.wait(20)
    b.close()
    idx.go.set()
    th.join(20)
    assert isinstance(out.get("error"), ClosedError), out


def test_transfer_racing_remove_remote_is_unknown_peer(make_backend):
    b, buf, lp, t, tbuf, name, rp = _pair(make_backend)
    idx = _GatedIdx(range(N))
    th, out = _thread(lambda: b.transfer(Op.READ, lp, idx, rp, np.arange(N, dtype=np.int32)))
    assert idx.entered.wait(20)
    b.remove_remote(name)
    idx.go.set()
    th.join(20)
    assert isinstance(out.get("error"), UnknownPeer), out


def test_transfer_racing_deregister_is_refused_not_posted(make_backend):
    """The old code posted it with a prepped list whose registration NIXL had
    freed (the bytes landed in deregistered memory)."""
    b, buf, lp, t, tbuf, name, rp = _pair(make_backend)
    idx = _GatedIdx(range(N))
    th, out = _thread(lambda: b.transfer(Op.READ, lp, idx, rp, np.arange(N, dtype=np.int32)))
    assert idx.entered.wait(20)
    b.deregister(next(iter(b._regs)))
    idx.go.set()
    th.join(20)
    assert isinstance(out.get("error"), InvalidDescriptor), out
    assert not buf.any(), "bytes landed in deregistered memory"


def test_transfer_racing_release_of_its_prep_is_invalid_handle(make_backend):
    b, buf, lp, t, tbuf, name, rp = _pair(make_backend)
    idx = _GatedIdx(range(N))
    th, out = _thread(lambda: b.transfer(Op.READ, lp, idx, rp, np.arange(N, dtype=np.int32)))
    assert idx.entered.wait(20)
    b.release(rp)
    idx.go.set()
    th.join(20)
    assert isinstance(out.get("error"), InvalidHandle), out


def test_release_racing_close_frees_the_nixl_handle_once(make_backend):
    b, buf, lp = _local(make_backend)
    h = b.transfer(Op.READ, lp, None, lp, None)
    spy = _Spy(b)
    gated = _GatedInt(h)
    th, out = _thread(lambda: b.release(gated))
    assert gated.entered.wait(20)

    class Regs(dict):
        def values(self):  # close() is past its transfer records, before its last frees
            gated.go.set()
            th.join(2)  # the fixed close() holds NIXL's lock: release() waits for it
            return dict.values(self)

    b._regs = Regs(b._regs)
    b.close()
    gated.go.set()
    th.join(20)
    assert not th.is_alive()
    assert spy.bad == []
    assert "error" not in out or isinstance(out["error"], ClosedError), out


def test_check_state_racing_close_does_not_poll_a_freed_handle(make_backend):
    b, buf, lp = _local(make_backend)
    h = b.transfer(Op.READ, lp, None, lp, None)
    _in_flight(b, h, None)
    spy = _Spy(b, in_progress=True)
    go, entered = threading.Event(), threading.Event()

    def tracer(frame, event, arg):  # pause check_state just before it polls NIXL
        if frame.f_code.co_name not in ("check_state", "_check_state"):  # (the Python path)
            return None
        if event == "line" and linecache.getline(frame.f_code.co_filename,
                                                 frame.f_lineno).strip() == "self._poll(x)":
            entered.set()
            go.wait(20)
        return tracer

    def poll():
        sys.settrace(tracer)
        try:
            return b.check_state(h)
        finally:
            sys.settrace(None)

    th, out = _thread(poll)
    assert entered.wait(20)

    real = b._epoch

    class Epoch:  # close() is past its frees, before it drops the agent
        def close(self):
            go.set()
            th.join(2)
            real.close()

        def __getattr__(self, attr):
            return getattr(real, attr)

    b._epoch = Epoch()
    b.close()
    go.set()
    th.join(20)
    assert spy.bad == []
    assert isinstance(out.get("error"), ClosedError), out


def test_release_racing_remove_remote_frees_the_nixl_handle_once(make_backend):
    """remove_remote ends (and frees) the peer's transfers in flight while
    another thread releases one of them."""
    b, buf, lp, t, tbuf, name, rp = _pair(make_backend)
    h = b.transfer(Op.READ, lp, None, rp, None)
    _in_flight(b, h, name)
    spy = _Spy(b, in_progress=True)
    outs = []

    def tracer(frame, event, arg):  # right after _drop_peer's free, release() from another thread
        if frame.f_code.co_name != "_free_xfer":
            return None
        if event == "line" and not outs and linecache.getline(
                frame.f_code.co_filename, frame.f_lineno).strip() == "x.handle = None":
            th, out = _thread(lambda: b.release(h))
            outs.append((th, out))
            th.join(2)  # the old code frees here; the fixed one holds NIXL's lock, so release() waits
        return tracer

    sys.settrace(tracer)
    try:
        b.remove_remote(name)
    finally:
        sys.settrace(None)
    if outs:
        th, out = outs[0]
        th.join(20)
        assert not th.is_alive() and "error" not in out, out
    else:
        b.release(h)
    assert spy.bad == []
    with pytest.raises(InvalidHandle):
        b.release(h)


def test_deadline_turns_to_err_once_and_stays_releasable(make_backend):
    b, buf, lp = _local(make_backend)
    h = b.transfer(Op.READ, lp, None, lp, None)
    x = _in_flight(b, h, None)
    spy = _Spy(b, in_progress=True)
    assert b.check_state(h) is XferState.PROC
    x.deadline = 0.0  # its deadline passed
    s = b.check_state(h)
    assert s.failed and isinstance(s.cause, TransferTimeout)
    assert b.check_state(h) is s  # ERR stays ERR, NIXL not asked again
    b.release(h)
    with pytest.raises(InvalidHandle):
        b.release(h)
    with pytest.raises(InvalidHandle):
        b.check_state(h)
    assert spy.bad == []


@pytest.mark.parametrize("bad", [[1], {}, bytearray(b"x")])
def test_unhashable_handles_and_peer_names_are_kvt_errors(make_backend, bad):
    b, buf, lp = _local(make_backend)
    for verb in (b.release, b.check_state, b.deregister):
        with pytest.raises(InvalidHandle):
            verb(bad)
    with pytest.raises(UnknownPeer):
        b.remove_remote(bad)
    with pytest.raises(UnknownPeer):
        b.notify(bad, b"x")
    with pytest.raises(UnknownPeer):
        b.prep(bad, Descs.from_blocks(buf.ctypes.data, BLOCK, range(N)))
