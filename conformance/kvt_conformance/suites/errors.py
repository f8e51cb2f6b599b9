"""Errors: unknown peers, descriptors outside registered memory, released
handles, operations outside the declared capabilities, calls after close,
and bad arguments of every verb: each raises its typed kvt error (nothing
else escapes) before any byte moves, and leaves the backend usable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
from kvt.errors import (ClosedError, ConfigError, InvalidArgument, InvalidDescriptor, InvalidHandle,
                        UnknownPeer, UnsupportedOperation, WireError)
from kvt.types import Descs, MemKind, Op

from ..buffers import Buffer, pattern
from ..fixtures import BackendFixtures, expect_done
from ..requirements import check, requires
from ._common import assert_bytes, assert_released

BLOCK, N = 256, 8
_NO_SUCH_HANDLE = 424242
#: a length that makes a row's end pass 2**64 and wrap to 8 bytes after its start
_WRAPS = (1 << 64) - 8


@dataclass
class Setup:
    """Two registered local buffers, prepped as N blocks each."""

    backend: Any
    src: Buffer
    dst: Buffer
    sp: Any
    dp: Any
    other: Any  #: a prepped list of a different block length


@dataclass
class PeerSetup:
    """A registered local buffer and a peer's, prepped as N blocks each."""

    backend: Any
    lp: Any     #: this agent's list
    rp: Any     #: the peer's list
    rhalf: Any  #: the peer's list in rows of half the length


def _op(backend) -> Op:
    return min(backend.capabilities.ops, key=lambda o: o.value)  # READ where declared


def _notif_error(backend) -> type:
    return InvalidArgument if backend.capabilities.notifications else UnsupportedOperation


def _zeros_into_src(s: "Setup"):
    """A good local transfer that leaves ``dst`` as it is (it moves dst's zeros into src's block 0)."""
    op = _op(s.backend)
    return s.backend.transfer(op, s.sp, [0], s.dp, [0]) if op is Op.READ else s.backend.transfer(op, s.dp, [0], s.sp,
                                                                                                   [0])


# name -> (call, expected error); the call gets a Setup
BAD_CALLS: dict[str, tuple[Callable[[Setup], Any], Any]] = {
    "get_xfer_descs-text": (lambda s: s.backend.get_xfer_descs("nonsense"), InvalidArgument),
    "get_xfer_descs-floats": (lambda s: s.backend.get_xfer_descs(np.array([[1.5, 2.0, 0.0]])), InvalidArgument),
    "get_xfer_descs-negative": (lambda s: s.backend.get_xfer_descs([(-1, 10, 0)]), InvalidArgument),
    "get_xfer_descs-bad-kind": (lambda s: s.backend.get_xfer_descs([(4096, 10, 0)], "SSD"), InvalidArgument),
    "register-text": (lambda s: s.backend.register("abc"), InvalidArgument),
    "register-negative": (lambda s: s.backend.register(np.array([[-5, 10, 0]])), InvalidArgument),
    "prep-text": (lambda s: s.backend.prep(None, "abc"), InvalidArgument),
    "prep-none": (lambda s: s.backend.prep(None, None), InvalidArgument),
    "prep-unknown-peer": (lambda s: s.backend.prep("no-such-agent", s.src.blocks(BLOCK, [0])), UnknownPeer),
    "transfer-bad-op": (lambda s: s.backend.transfer("COPY", s.dp, [0], s.sp, [0]), InvalidArgument),
    "transfer-index-out-of-range": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [N], s.sp, [0]), InvalidArgument),
    "transfer-negative-index": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [-1], s.sp, [0]), InvalidArgument),
    "transfer-float-index": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [0.5], s.sp, [0]), InvalidArgument),
    "transfer-2d-index": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [[0]], s.sp, [[0]]), InvalidArgument),
    "transfer-count-mismatch": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [0, 1], s.sp, [0]), InvalidArgument),
    "transfer-length-mismatch": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [0], s.other, [0]), InvalidArgument),
    "transfer-unknown-prep": (lambda s: s.backend.transfer(_op(s.backend), _NO_SUCH_HANDLE, [0], s.sp, [0]), InvalidHandle),
    "transfer-notif-not-bytes": (lambda s: s.backend.transfer(_op(s.backend), s.dp, [0], s.sp, [0], notif="text"),
                                 _notif_error),
    "transfer-notif-too-large": (lambda s: s.backend.transfer(
        _op(s.backend), s.dp, [0], s.sp, [0], notif=bytes(s.backend.capabilities.max_notif_bytes + 1)), _notif_error),
    # a wait that could never end (inf, NaN) is refused, as is a non-number
    **{f"transfer-wait-{name}": (lambda s, t=t: s.backend.wait(_zeros_into_src(s), t), InvalidArgument)
       for name, t in (("nan", float("nan")), ("inf", float("inf")), ("text", "1"))},
    "check_state-unknown": (lambda s: s.backend.check_state(_NO_SUCH_HANDLE), InvalidHandle),
    "check_state-text": (lambda s: s.backend.check_state("x"), InvalidHandle),
    "release-unknown": (lambda s: s.backend.release(_NO_SUCH_HANDLE), InvalidHandle),
    "release-none": (lambda s: s.backend.release(None), InvalidHandle),
    "deregister-none": (lambda s: s.backend.deregister(None), InvalidHandle),
    "add_remote-none": (lambda s: s.backend.add_remote(None), WireError),
    "add_remote-text": (lambda s: s.backend.add_remote("metadata"), WireError),
    "remove_remote-unknown": (lambda s: s.backend.remove_remote("no-such-agent"), UnknownPeer),
}

# the same for a transfer with a peer
BAD_PEER_CALLS: dict[str, tuple[Callable[[PeerSetup], Any], Any]] = {
    "bad-op": (lambda s: s.backend.transfer("COPY", s.lp, [0], s.rp, [0]), InvalidArgument),
    "local-index-out-of-range": (lambda s: s.backend.transfer(_op(s.backend), s.lp, [N], s.rp, [0]), InvalidArgument),
    "remote-index-out-of-range": (lambda s: s.backend.transfer(_op(s.backend), s.lp, [0], s.rp, [N]), InvalidArgument),
    "negative-index": (lambda s: s.backend.transfer(_op(s.backend), s.lp, [0], s.rp, [-1]), InvalidArgument),
    "count-mismatch": (lambda s: s.backend.transfer(_op(s.backend), s.lp, [0, 1], s.rp, [0]), InvalidArgument),
    "length-mismatch": (lambda s: s.backend.transfer(_op(s.backend), s.lp, [0], s.rhalf, [0]), InvalidArgument),
    "unknown-remote-prep": (lambda s: s.backend.transfer(_op(s.backend), s.lp, [0], _NO_SUCH_HANDLE, [0]),
                            InvalidHandle),
    "peer-list-as-local": (lambda s: s.backend.transfer(_op(s.backend), s.rp, [0], s.rp, [1]), InvalidArgument),
    "notif-too-large": (lambda s: s.backend.transfer(
        _op(s.backend), s.lp, [0], s.rp, [0], notif=bytes(s.backend.capabilities.max_notif_bytes + 1)), _notif_error),
}

# bad messages for ``notify`` to a loaded peer (name -> message, expected error)
BAD_NOTIFY_CALLS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "too-large": (lambda b: bytes(b.capabilities.max_notif_bytes + 1), _notif_error),
    "text": (lambda b: "text", _notif_error),
    "none": (lambda b: None, _notif_error),
    "int": (lambda b: 7, _notif_error),
}


class ErrorTests(BackendFixtures):
    area = "errors"

    @pytest.fixture
    def setup(self, backend, local_buffer) -> Setup:
        src, dst = local_buffer(BLOCK * N, seed=1), local_buffer(BLOCK * N)
        sp, dp = backend.prep(None, src.blocks(BLOCK, range(N))), backend.prep(None, dst.blocks(BLOCK, range(N)))
        other = backend.prep(None, src.blocks(BLOCK // 2, range(N)))
        return Setup(backend, src, dst, sp, dp, other)

    def _still_works(self, s: Setup, wait_for: float) -> None:
        """A good local transfer after the bad calls moves the right bytes."""
        if not s.backend.capabilities.local:
            return
        if Op.READ in s.backend.capabilities.ops:
            h = s.backend.transfer(Op.READ, s.dp, None, s.sp, None)
        else:
            h = s.backend.transfer(Op.WRITE, s.sp, None, s.dp, None)
        expect_done(s.backend, h, wait_for)
        assert_bytes(s.dst.read(), s.src.read())

    @pytest.mark.parametrize("case", list(BAD_CALLS))
    def test_bad_call_raises_its_kvt_error(self, setup, target, case, wait_for):
        if case.startswith("transfer-"):
            check(target.cls, "local")  # both sides are this agent's lists
        call, error = BAD_CALLS[case]
        if not isinstance(error, type):
            error = error(setup.backend)
        with pytest.raises(error):
            call(setup)
        assert not setup.dst.read().any(), "a refused call moved bytes"
        self._still_works(setup, wait_for)

    @pytest.mark.parametrize("case", list(BAD_PEER_CALLS))
    def test_bad_transfer_with_a_peer_raises_its_kvt_error(self, backend, local_buffer, peer, case, wait_for):
        """The argument checks of ``transfer``, with the far side in a peer:
        a backend that declares no local transfers gets them here too."""
        near, far = local_buffer(BLOCK * N, seed=1), peer.alloc(BLOCK * N, seed=2)
        name = backend.add_remote(peer.metadata())
        s = PeerSetup(backend, backend.prep(None, near.blocks(BLOCK, range(N))),
                      backend.prep(name, far.blocks(BLOCK, range(N))), backend.prep(name, far.blocks(BLOCK // 2, range(N))))
        call, error = BAD_PEER_CALLS[case]
        if not isinstance(error, type):
            error = error(backend)
        with pytest.raises(error):
            call(s)
        assert_bytes(near.read(), pattern(1, BLOCK * N), "this agent's memory after the refused call (nothing may move)")
        assert_bytes(far.read(), pattern(2, BLOCK * N), "the peer's memory after the refused call (nothing may move)")

    @pytest.mark.parametrize("case", list(BAD_NOTIFY_CALLS))
    def test_bad_notify_raises_its_kvt_error(self, backend, peer, case, wait_for):
        """``notify`` of a message longer than ``max_notif_bytes``, or not
        bytes: ``InvalidArgument`` (``UnsupportedOperation`` where
        notifications are not declared), and nothing reaches the peer (a
        marker sent next is the first message it gets)."""
        name = backend.add_remote(peer.metadata())
        make, error = BAD_NOTIFY_CALLS[case]
        with pytest.raises(error(backend)):
            backend.notify(name, make(backend))
        if backend.capabilities.notifications:
            backend.notify(name, b"marker")  # messages to one peer arrive in order: a sent refused one comes first
            got = peer.take_notifs(backend.agent_name, 1, wait_for)
            assert got == [b"marker"], (f"the peer's first message after a refused notify is {got!r:.80}, expected "
                                        "the marker sent next: a refused notify must send nothing")

    @pytest.mark.parametrize("name", ["no-such-agent", ["no-such-agent"], {}], ids=["str", "list", "dict"])
    def test_unknown_peer(self, backend, local_buffer, name):
        """A peer name nobody loaded, also one that is not even hashable
        (a dict lookup raises TypeError: use ``PeerTable.named``)."""
        buf = local_buffer(1024)
        with pytest.raises(UnknownPeer):
            backend.prep(name, buf.blocks(256, [0]))
        with pytest.raises(UnknownPeer):
            backend.remove_remote(name)
        if backend.capabilities.notifications:
            with pytest.raises(UnknownPeer):
                backend.notify(name, b"x")

    @pytest.mark.parametrize("how", ["unregistered", "past-the-end", "before-the-start", "deregistered",
                                     "one-byte-past-the-end", "one-byte-before-the-start", "length-wraps"])
    def test_local_descriptors_outside_registered_memory(self, backend, make_backend, how):
        buf = make_backend.keep(Buffer(4096))
        handle = backend.register(Descs.from_regions(buf.addr + 1024, 2048))
        rows = {"unregistered": Descs.from_regions(make_backend.keep(Buffer(1024)).addr, 1024),
                "past-the-end": Descs.from_regions(buf.addr + 3072 - 16, 32),
                "before-the-start": Descs.from_regions(buf.addr + 1024 - 16, 32),
                "deregistered": Descs.from_regions(buf.addr + 1024, 256),
                "one-byte-past-the-end": Descs.from_regions(buf.addr + 3072 - 16, 17),
                "one-byte-before-the-start": Descs.from_regions(buf.addr + 1024 - 1, 17),
                # address + length passes 2**64 and, wrapped, ends inside the region
                "length-wraps": Descs.from_regions(buf.addr + 1024 + 16, _WRAPS)}[how]
        if how == "deregistered":
            backend.deregister(handle)
        with pytest.raises(InvalidDescriptor):
            backend.prep(None, rows)

    @pytest.mark.parametrize("how", ["unregistered", "past-the-end", "one-bad-row-of-many",
                                     "one-byte-past-the-end", "length-wraps"])
    def test_peer_descriptors_outside_registered_memory(self, backend, peer, how):
        """A READ or WRITE can never reach peer memory the peer did not register."""
        registered, loose = peer.alloc(4096), peer.alloc(4096, register=False)
        name = backend.add_remote(peer.metadata())
        rows = {"unregistered": loose.blocks(1024, [0]),
                "past-the-end": Descs.from_regions(registered.addr + 4096 - 16, 32),
                "one-bad-row-of-many": Descs(np.concatenate([registered.blocks(256, range(15)).array,
                                                             loose.blocks(256, [0]).array])),
                "one-byte-past-the-end": Descs.from_regions(registered.addr + 4096 - 16, 17),
                "length-wraps": Descs.from_regions(registered.addr + 16, _WRAPS)}[how]
        with pytest.raises(InvalidDescriptor):
            backend.prep(name, rows)

    @requires("local")
    def test_released_handles(self, setup, wait_for):
        b = setup.backend
        h = b.transfer(_op(b), setup.dp, [0], setup.sp, [0])
        expect_done(b, h, wait_for)
        b.release(h)
        assert_released(b, h)
        b.release(setup.other)
        with pytest.raises(InvalidHandle):
            b.transfer(_op(b), setup.dp, [0], setup.other, [0])

    @pytest.mark.parametrize("kind", [MemKind.VRAM, MemKind.DEVICE], ids=lambda k: k.value)
    def test_undeclared_memory_kind(self, backend, make_backend, kind):
        if kind in backend.capabilities.mem_kinds:
            pytest.skip(f"{kind.value} is declared; this test covers undeclared kinds")
        host = make_backend.keep(Buffer(1024))
        rows = Descs.from_regions(host.addr, 1024, 0, kind)  # host memory labelled as device memory
        _all_raise(UnsupportedOperation, {"register": lambda: backend.register(rows),
                                          "prep": lambda: backend.prep(None, rows),
                                          "get_xfer_descs": lambda: backend.get_xfer_descs(rows.array, kind)})

    @requires("local")
    @pytest.mark.parametrize("op", list(Op), ids=lambda o: o.value)
    def test_undeclared_operation(self, setup, op):
        if op in setup.backend.capabilities.ops:
            pytest.skip(f"{op.value} is declared; this test covers undeclared operations")
        with pytest.raises(UnsupportedOperation):
            setup.backend.transfer(op, setup.dp, [0], setup.sp, [0])

    def test_undeclared_notifications(self, backend, peer):
        if backend.capabilities.notifications:
            pytest.skip("notifications are declared; this test covers backends without them")
        name = backend.add_remote(peer.metadata())
        with pytest.raises(UnsupportedOperation):
            backend.notify(name, b"x")

    def test_undeclared_local_transfer(self, backend, local_buffer):
        if backend.capabilities.local:
            pytest.skip("local transfers are declared; this test covers backends without them")
        a, b = local_buffer(1024, seed=1), local_buffer(1024)
        with pytest.raises(UnsupportedOperation):
            backend.transfer(_op(backend), backend.prep(None, a.blocks(256, range(4))), None,
                             backend.prep(None, b.blocks(256, range(4))), None)

    def test_undeclared_remote(self, backend, local_buffer, spawn_peer):
        """A backend that does not declare ``remote`` refuses a peer in another
        process with UnsupportedOperation (when loading it, prepping or transferring)."""
        if backend.capabilities.remote:
            pytest.skip("remote is declared; this test covers backends without it")
        other = spawn_peer()
        far, near = other.alloc(1024, seed=1), local_buffer(1024)
        with pytest.raises(UnsupportedOperation):
            name = backend.add_remote(other.metadata())
            h = backend.transfer(_op(backend), backend.prep(None, near.blocks(256, range(4))), None,
                                 backend.prep(name, far.blocks(256, range(4))), None)
            backend.check_state(h)

    def test_calls_after_close(self, make_backend, local_buffer):
        b = make_backend()
        buf = local_buffer(1024, owner=b)
        prep = b.prep(None, buf.blocks(256, range(4)))
        md = b.local_metadata()
        b.close()
        b.close()  # idempotent
        calls = {
            "register": lambda: b.register(buf.region()), "deregister": lambda: b.deregister(1),
            "get_xfer_descs": lambda: b.get_xfer_descs(buf.region()), "local_metadata": b.local_metadata,
            "add_remote": lambda: b.add_remote(md), "remove_remote": lambda: b.remove_remote("x"),
            "prep": lambda: b.prep(None, buf.blocks(256, [0])),
            "transfer": lambda: b.transfer(_op(b), prep, [0], prep, [1]),
            "check_state": lambda: b.check_state(1), "release": lambda: b.release(prep),
            "get_notifs": b.get_notifs,
        }
        if b.capabilities.notifications:
            calls["notify"] = lambda: b.notify("x", b"x")
        _all_raise(ClosedError, calls)

    def test_unknown_option_is_refused(self, make_backend, target):
        """A misspelt option must not silently become its default: the
        constructor raises ``ConfigError`` naming the key."""
        if target.cls.option_names is None:
            pytest.skip(f"{target.label} declares no option_names: kvt cannot tell a typo from an option")
        key = "no_such_option_" + "x" * 8
        with pytest.raises(ConfigError, match=key):
            make_backend(**{key: 1})
        make_backend()  # and the refused one left nothing behind that stops the next

    @pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "5", True])
    def test_bad_timeout_is_refused(self, make_backend, timeout):
        """``timeout`` bounds every wait: a NaN, negative, infinite or
        non-number one must be refused at construction (``ConfigError``,
        naming it), not break the first wait built on it."""
        with pytest.raises(ConfigError, match="timeout"):
            make_backend(timeout=timeout)
        make_backend()


def _all_raise(error: type, calls: dict[str, Callable[[], Any]]) -> None:
    """Every call raises ``error``; the failure names each one that did not."""
    wrong = []
    for verb, call in calls.items():
        try:
            call()
        except error:
            continue
        except Exception as e:  # noqa: BLE001 - reported, not swallowed
            wrong.append(f"{verb} raised {type(e).__name__}: {e}")
        else:
            wrong.append(f"{verb} returned normally")
    assert not wrong, f"expected {error.__name__} from every call; " + "; ".join(wrong)
