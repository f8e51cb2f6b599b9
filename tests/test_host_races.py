"""The host backend's same-host paths (shm, cma) while other threads re-add,
remove or close the peer a post is using: a post succeeds or fails with a
typed kvt error (never a ValueError, AttributeError or a TransferError
wrapping one), nothing lands after ``remove_remote`` returned, nothing
crashes or hangs.  Posts go through the backend's verbs in threads of their
own; the peer is a real process owning the memory."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from kvt import Agent, Descs, Op, memory
from kvt.errors import ClosedError, InvalidHandle, PeerDisconnected, TransferError, UnknownPeer
from kvt.agent import fetch_info
from kvt.wire import decode
from kvt_host.backend import HostBackend
from kvt_host.protocol import HostMetadata, rows_of

from peer import BLOCK, NUM_BLOCKS, pattern, peer_process

pytestmark = pytest.mark.timeout(120)

# remote blocks read, local blocks they land in: each block 8 times (2 MiB), so a copy lasts long enough to be raced
SRC, DST = np.tile(np.arange(NUM_BLOCKS)[::-1], 8), np.tile(np.arange(NUM_BLOCKS), 8)


@pytest.fixture(scope="module", params=["shm", "cma"])
def far(request):
    """(peer metadata, its block rows): memory in shared segments (shm) or not (cma)."""
    with peer_process(shared=request.param == "shm") as p:
        md = fetch_info(p.endpoint, "me", 20).metadata
        base = int(rows_of(decode(md, HostMetadata).regions["DRAM"])[0, 0])
        yield md, Descs.from_regions(base + np.arange(NUM_BLOCKS, dtype=np.uint64) * BLOCK, [BLOCK] * NUM_BLOCKS)


def _setup(be: HostBackend, md: bytes):
    local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
    be.register(Descs.from_buffers([local]))
    return local, be.prep(None, Descs.from_regions(local.ctypes.data + np.arange(NUM_BLOCKS) * BLOCK,
                                                   [BLOCK] * NUM_BLOCKS)), be.add_remote(md)


def _wrong(e: BaseException) -> bool:
    """Not a typed kvt error saying what happened (or one wrapping a Python error)."""
    if not isinstance(e, (UnknownPeer, PeerDisconnected, ClosedError, InvalidHandle, TransferError)):
        return True
    text = str(e)
    return type(e) is TransferError and "closed" not in text or "Error:" in text or "descriptor" in text


class Posters:
    """Threads reading SRC into DST through ``be`` until stopped; they keep
    what went wrong, and re-prep the peer when it is unknown."""

    def __init__(self, be: HostBackend, lp, name: str, rows: Descs, n: int = 2, notify: bool = False):
        self.be, self.lp, self.name, self.rows, self.notify = be, lp, name, rows, notify
        self.ok, self.errors, self.wrong = 0, [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._post, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _post(self) -> None:
        be, rp = self.be, None
        while not self.stop.is_set():
            try:
                if rp is None:
                    rp = be.prep(self.name, self.rows)
                h = be.transfer(Op.READ, self.lp, DST, rp, SRC)
                try:
                    state = be.wait(h, 10)
                    assert not state.pending, "a transfer hung"
                    if state.failed:
                        raise state.cause
                finally:
                    be.release(h)
                if self.notify:
                    be.notify(self.name, b"n")
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - sorted below
                self.errors.append(e)
                if _wrong(e):
                    self.wrong.append(f"{type(e).__name__}: {e}")
                if isinstance(e, UnknownPeer):
                    rp = None
                elif isinstance(e, ClosedError):
                    return
                time.sleep(0.0001)  # a removed peer: let the remover run

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads), "a post hung"


def test_posts_racing_add_remote_of_the_same_peer_all_succeed(far):
    """``Agent.reconnect`` re-adds unchanged metadata: the epoch page and
    pidfd are replaced on the peer's lane while posts run on theirs."""
    md, rows = far
    with Agent(name="me", options={"timeout": 5}) as me:
        local, lp, name = _setup(me.backend, md)
        posters = Posters(me.backend, lp, name, rows)
        try:
            for i in range(600):
                me.backend.add_remote(md)
                time.sleep(0.0005 * (i % 3))
        finally:
            posters.join()
        assert not posters.errors, [f"{type(e).__name__}: {e}" for e in posters.errors[:3]]
        assert posters.ok and np.array_equal(local[DST], pattern()[SRC])


@pytest.mark.parametrize("inline_bytes", [1 << 24, 1], ids=["inline", "worker"])
def test_posts_racing_remove_remote_fail_typed_and_land_nothing_after_it(far, inline_bytes):
    md, rows = far
    with Agent(name="me", options={"timeout": 5, "inline_bytes": inline_bytes}) as me:
        be = me.backend
        local, lp, name = _setup(be, md)
        posters = Posters(be, lp, name, rows, notify=True)
        landed = 0
        try:
            for i in range(300):
                time.sleep(0.0005 * (i % 3))
                be.remove_remote(name)
                local[:] = 0
                time.sleep(0.001)  # posts meanwhile must not land
                landed += bool(local.any())
                be.add_remote(md)
        finally:
            posters.join()
        assert not posters.wrong, posters.wrong[:3]
        assert not landed, f"bytes landed after remove_remote returned, {landed} times of 300"
        assert posters.ok, "no post succeeded"


def test_posts_racing_close_fail_typed():
    """A fresh backend per round, closed while posts to a same-host peer run."""
    with peer_process(shared=True) as p:
        md = fetch_info(p.endpoint, "me", 20).metadata
        base = int(rows_of(decode(md, HostMetadata).regions["DRAM"])[0, 0])
        rows = Descs.from_regions(base + np.arange(NUM_BLOCKS, dtype=np.uint64) * BLOCK, [BLOCK] * NUM_BLOCKS)
        wrong, ok = [], 0
        for i in range(40):
            be = HostBackend(f"me{i}", {"timeout": 5, "inline_bytes": 1 if i % 2 else 1 << 24})
            try:
                _, lp, name = _setup(be, md)
                posters = Posters(be, lp, name, rows, notify=i % 4 == 3)  # (a notification keeps the lane busy)
                time.sleep(0.01)
                be.close()
                posters.join()
            finally:
                be.close()
            wrong += posters.wrong
            ok += posters.ok
        assert not wrong, wrong[:3]
        assert ok


def test_concurrent_release_of_one_transfer_is_quiet():
    """Two threads release the same Transfer, both past its "released?" check
    before either marks it: one frees the handle, the other does nothing.
    (The C post path's ``release`` checks and marks without letting another
    thread in: there the two threads simply race.)"""
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        abuf, bbuf = np.zeros((4, 256), np.uint8), np.ones((4, 256), np.uint8)
        a.register_blocks("kv", [abuf])
        b.register_blocks("kv", [bbuf])
        peer = a.add_peer(b.info())
        for _ in range(5):
            x = a.read_blocks(peer, [0], [1])
            x.wait(10)
            both = threading.Barrier(2)
            errors = []

            code = getattr(type(x).release, "__code__", None)  # (None: C)

            def tracer(frame, event, arg):  # meet the other thread at the release's second line
                if frame.f_code is code:
                    lines = [0]

                    def step(frame, event, arg):
                        if event == "line":
                            lines[0] += 1
                            if lines[0] == 2:
                                try:
                                    both.wait(2)
                                except threading.BrokenBarrierError:
                                    pass
                        return step
                    return step
                return None

            def release():
                sys.settrace(tracer)
                try:
                    x.release()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{type(e).__name__}: {e}")
                finally:
                    sys.settrace(None)

            threads = [threading.Thread(target=release) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors
            assert x.handle not in a.backend._xfers
            with pytest.raises(InvalidHandle):
                x.state()


def test_close_returns_after_a_peer_write_still_landing(monkeypatch):
    """A peer's stream WRITE passed its check and its bytes are being
    copied in when the owner closes: close returns only once that copy
    ended, since the caller may free the memory next (it returned at once and
    the copy ran on into memory already freed: SIGSEGV)."""
    import kvt_host.stream as stream

    copying, landed, real = threading.Event(), threading.Event(), stream.scatter

    def slow_scatter(rows, buf):  # the owner's stream thread, mid-copy, when close() is called
        copying.set()
        time.sleep(0.5)
        real(rows, buf)
        landed.set()

    monkeypatch.setattr(stream, "scatter", slow_scatter)
    owner = HostBackend("owner", {"timeout": 10})
    writer = HostBackend("writer", {"timeout": 10, "transport": "tcp"})
    try:
        dst, src = np.zeros(64 * 4096, np.uint8), np.full(64 * 4096, 7, np.uint8)
        owner.register(Descs.from_buffers([dst]))
        writer.register(Descs.from_buffers([src]))
        blocks = np.arange(64, dtype=np.uint64) * 4096
        peer = writer.add_remote(owner.local_metadata())
        rp = writer.prep(peer, Descs.from_regions(dst.ctypes.data + blocks, [4096] * 64))
        lp = writer.prep(None, Descs.from_regions(src.ctypes.data + blocks, [4096] * 64))
        writer.transfer(Op.WRITE, lp, np.arange(64), rp, np.arange(64))
        assert copying.wait(20)
        owner.close()
        assert landed.is_set(), "close returned while a peer's WRITE was still copying into its memory"
    finally:
        writer.close()
        owner.close()


def test_mirror_translation_is_consistent_while_another_region_is_deregistered(monkeypatch):
    """A server thread translating a peer's rows in device region B while the
    owner deregisters region A, registered before B (which renumbers B): the
    address is B's mirror.  The table used to be published field by field,
    so a translation mixed the new region numbers with the old mirror
    addresses (another region's freed mirror: a wild write)."""
    torch = pytest.importorskip("torch")
    from kvt_host.staging import Mirrors

    a, b = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    mirrors = Mirrors()
    mirrors.add(1, Descs.from_buffers([a]))
    mirrors.add(2, Descs.from_buffers([b]))
    rows = np.array([[b.data_ptr() + 100, 8, 0]], np.uint64)
    expect = mirrors.translate(rows)
    locate = Descs.locate

    def locate_then_deregister(self, regions):  # the owner's deregister lands between the lookups
        monkeypatch.setattr(Descs, "locate", locate)
        out = locate(self, regions)
        mirrors.remove(1)
        return out

    monkeypatch.setattr(Descs, "locate", locate_then_deregister)
    assert mirrors.translate(rows).tolist() == expect.tolist()
    assert mirrors.translate(rows).tolist() == expect.tolist()  # and after it


@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_deregister_returns_only_after_a_same_host_copy_in_flight_ends(op):
    """A same-host copy holds the owner's epoch lock while it runs: the
    owner's ``deregister`` (bump, then drain) returns only after it, so the
    owner may reuse the memory at once.  Here the owner overwrites it the
    instant ``deregister`` returns: a WRITE must not land on that, and a
    READ must not count (it may have read the overwrite)."""
    size = 256 << 20  # one row: tens of ms of copy, front to back, to deregister in the middle of
    with HostBackend("owner", {"timeout": 10}) as owner, HostBackend("me", {"timeout": 10}) as me:
        far = memory.empty(size)
        far.fill(0x11 if op is Op.READ else 0)
        reg = owner.register(Descs.from_buffers([far]))
        near = memory.empty(size)
        near.fill(0x22 if op is Op.WRITE else 0)
        me.register(Descs.from_buffers([near]))
        name = me.add_remote(owner.local_metadata())
        lp, rp = me.prep(None, Descs.from_buffers([near])), me.prep(name, Descs.from_buffers([far]))
        assert me._peers[name].same_host, "the two backends should share this host's fast path"
        h = me.transfer(op, lp, [0], rp, [0])
        dst = far if op is Op.WRITE else near
        deadline = time.monotonic() + 10
        while not dst[:4096].any():  # the copy has begun (it runs on the lane's worker)
            assert time.monotonic() < deadline, "the copy never started"
        landed_at_return = bool(dst[-4096:].any())
        owner.deregister(reg)
        assert landed_at_return or dst[-4096:].any(), \
            "deregister returned while a same-host copy of that memory was still under way"
        far.fill(0xFF)  # reused the instant deregister returned
        state = me.wait(h, 10)
        me.release(h)
        if op is Op.WRITE:
            assert (far == 0xFF).all(), "a WRITE landed in memory after its owner's deregister had returned"
        else:
            assert not (near == 0xFF).any(), "a READ read memory its owner overwrote after deregister returned"
            assert state.done or state.failed
