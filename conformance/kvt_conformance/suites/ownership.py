"""Owner-side checks: the owner of memory serves only what it has
registered *now*.  Initiator-side checks at ``prep`` are a courtesy; this
suite goes around them with stale metadata (the owner deregisters after the
initiator loaded its metadata and prepped), so a backend whose target
trusts the initiator's word is seen moving bytes of memory that is no
longer registered."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvt.errors import KvtError, RemoteRejected
from kvt.types import Op

from ..fixtures import BackendFixtures, settle
from ..requirements import requires
from ._common import SLOW_BLOCK, SLOW_BYTES, assert_bytes

#: what Capabilities.owner_check may say
OWNER_CHECKS = ("server", "transport")
#: times the owner deregisters memory a stream of transfers is using
DEREGISTER_REPEATS = 6
#: times an owner (a new peer each) closes while a stream of transfers uses its memory
CLOSE_REPEATS = 4
#: seconds between the owner's close and removing it, for late bytes to land
CLOSE_GRACE = 0.25


def _assert_refused(backend, op: Op, lp, rp, wait_for, what: str, check: str) -> None:
    """Post ``op``: refused at once, or ERR with ``RemoteRejected``."""
    try:
        handle = backend.transfer(op, lp, None, rp, None)
    except RemoteRejected:
        return  # refused before posting: as good
    state = settle(backend, handle, wait_for)
    assert state.failed and isinstance(state.cause, RemoteRejected), (
        f"a {op.value} {what} ended {state!r}; expected ERR with RemoteRejected: the owner must check "
        f"{check} and refuse the rest with RemoteRejected")


class OwnerCheckTests(BackendFixtures):
    area = "owner checks"
    block = 4096
    nblocks = 64

    @requires("remote")
    def test_declares_how_the_owner_checks(self, target):
        how = target.caps.owner_check
        assert how in OWNER_CHECKS, (
            f"{target.cls.__name__}.capabilities.owner_check is {how!r}, expected one of {OWNER_CHECKS}: "
            "declare 'server' if a target-side server checks every request against its registrations and "
            "answers RemoteRejected, or 'transport' if the transport's remote keys exist only for registered "
            "memory (see docs/plugin-guide.md, 'The owner checks')")

    def test_stale_metadata_is_refused(self, backend, local_buffer, peer, op, wait_for):
        """The peer deregisters after we loaded its metadata and prepped: the
        transfer must end in ERR with ``RemoteRejected``, and nothing moves."""
        size = self.block * self.nblocks
        ids = np.arange(self.nblocks)
        near = local_buffer(size, seed=41 if op is Op.WRITE else None)
        far = peer.alloc(size, seed=42 if op is Op.READ else None)
        before_near, before_far = near.read(), far.read()
        name = backend.add_remote(peer.metadata())
        lp, rp = backend.prep(None, near.blocks(self.block, ids)), backend.prep(name, far.blocks(self.block, ids))
        peer.deregister(far.key)  # the memory stays; only its registration goes
        _assert_refused(backend, op, lp, rp, wait_for, "of memory the peer deregistered after we loaded its "
                        "metadata", "against what it has registered now (not what its metadata said)")
        assert_bytes(near.read(), before_near, "this agent's memory after the refused transfer (nothing may move)")
        assert_bytes(far.read(), before_far, "the peer's memory after the refused transfer (nothing may move)")

    def test_stale_metadata_past_a_shrunk_registration_is_refused(self, backend, local_buffer, peer, op, wait_for):
        """The peer re-registers its buffer one byte shorter after we prepped
        its last block: that block's start is still registered, its last byte
        no longer is.  The owner must check where each row ends, not only
        where it starts: ERR with ``RemoteRejected``, nothing moved."""
        size = self.block * self.nblocks
        near = local_buffer(self.block, seed=43 if op is Op.WRITE else None)
        far = peer.alloc(size, seed=44 if op is Op.READ else None)
        before_near, before_far = near.read(), far.read()
        name = backend.add_remote(peer.metadata())
        lp = backend.prep(None, near.blocks(self.block, [0]))
        rp = backend.prep(name, far.blocks(self.block, [self.nblocks - 1]))
        peer.reregister(far.key, size - 1)
        _assert_refused(backend, op, lp, rp, wait_for, "of a block whose last byte the peer no longer has "
                        "registered", "that every row ends within what it has registered now, not only that it "
                        "starts there,")
        assert_bytes(near.read(), before_near, "this agent's memory after the refused transfer (nothing may move)")
        assert_bytes(far.read(), before_far, "the peer's memory after the refused transfer (nothing may move)")

    @requires("notifications")
    def test_refused_transfer_sends_no_notification(self, backend, local_buffer, peer, op, wait_for):
        """A transfer's notification tells the peer its bytes moved: one the
        owner refused (stale metadata, as above) must not send it.  A later
        message to the peer marks the end of what could have arrived."""
        size = self.block * self.nblocks
        ids = np.arange(self.nblocks)
        near = local_buffer(size, seed=45 if op is Op.WRITE else None)
        far = peer.alloc(size, seed=46 if op is Op.READ else None)
        name = backend.add_remote(peer.metadata())
        lp, rp = backend.prep(None, near.blocks(self.block, ids)), backend.prep(name, far.blocks(self.block, ids))
        peer.deregister(far.key)
        try:
            handle = backend.transfer(op, lp, None, rp, None, notif=b"refused")
        except RemoteRejected:
            handle = None
        if handle is not None:
            state = settle(backend, handle, wait_for)
            assert state.failed, f"a {op.value} of memory the peer deregistered ended {state!r}, expected ERR"
        backend.notify(name, b"marker")  # messages to one peer arrive in the order sent
        seen: list[bytes] = []
        while b"marker" not in seen:
            got = peer.take_notifs(backend.agent_name, 1, wait_for)
            assert got, f"the marker notification never arrived (got {seen!r} before it)"
            seen += got
        assert b"refused" not in seen, (
            f"the notification of a {op.value} the owner refused reached the peer: send a transfer's "
            "notification only once its bytes have moved, never for a transfer that ends in ERR")

    def test_deregister_waits_for_requests_in_flight(self, backend, local_buffer, peer, target, op, wait_for):
        """A backend whose server serves peers (``owner_check="server"``)
        returns from ``deregister`` only once no request touches that memory:
        the caller may free it next.  A thread keeps transfers of that memory
        in flight while the owner deregisters it and, the instant that
        returns, overwrites it (as freed and reused memory would be): no
        WRITE may land on the overwrite, and no READ may bring it back."""
        if target.caps.owner_check != "server":
            pytest.skip(f"owner_check is {target.caps.owner_check!r}; only 'server' backends promise that "
                        "deregister waits for peers' requests")
        ids = np.arange(SLOW_BYTES // SLOW_BLOCK)
        for rep in range(DEREGISTER_REPEATS):
            near = local_buffer(SLOW_BYTES, seed=4000 + rep if op is Op.WRITE else None)
            far = peer.alloc(SLOW_BYTES, seed=4000 + rep if op is Op.READ else None)
            src = (near if op is Op.WRITE else far).read()
            name = backend.add_remote(peer.metadata())
            lp, rp = backend.prep(None, near.blocks(SLOW_BLOCK, ids)), backend.prep(name, far.blocks(SLOW_BLOCK, ids))
            busy = _Busy(backend, op, lp, rp, wait_for)
            try:
                busy.first.wait(wait_for)  # the owner is serving: deregister now
                assert busy.settled, f"repetition {rep}: no {op.value} settled within {wait_for:g}s"
                peer.deregister(far.key, scribble=True)
            finally:
                busy.stop(wait_for)
            if op is Op.WRITE:
                assert_bytes(far.read(), np.full(SLOW_BYTES, 0xFF, np.uint8),
                             f"repetition {rep}: the peer's memory, overwritten the instant deregister returned "
                             "(a WRITE landed after deregister had returned: wait for the requests using it)")
            else:
                got = near.read()
                late = np.flatnonzero((got != src) & (got != 0))
                assert not late.size, (
                    f"repetition {rep}: {late.size} bytes READ into this agent are neither the peer's data nor "
                    f"untouched, first at offset {late[0]}: a READ still read the peer's memory after its "
                    "deregister had returned (wait for the requests using it)")

    def test_close_waits_for_requests_in_flight(self, backend, local_buffer, new_peer, target, op, wait_for):
        """``close`` is ``deregister`` for every registration: with
        ``owner_check="server"`` it returns only once no peer's request
        touches the memory.  As above, but the owner (a peer of this test's
        own, a new one each repetition) closes its backend instead, and
        overwrites the memory the instant ``close`` returns: no WRITE may
        land on the overwrite, and no READ may bring it back."""
        if target.caps.owner_check != "server":
            pytest.skip(f"owner_check is {target.caps.owner_check!r}; only 'server' backends promise that "
                        "close waits for peers' requests")
        ids = np.arange(SLOW_BYTES // SLOW_BLOCK)
        for rep in range(CLOSE_REPEATS):
            owner = new_peer()
            near = local_buffer(SLOW_BYTES, seed=4100 + rep if op is Op.WRITE else None)
            far = owner.alloc(SLOW_BYTES, seed=4100 + rep if op is Op.READ else None)
            src = (near if op is Op.WRITE else far).read()
            name = backend.add_remote(owner.metadata())
            lp, rp = backend.prep(None, near.blocks(SLOW_BLOCK, ids)), backend.prep(name, far.blocks(SLOW_BLOCK, ids))
            busy = _Busy(backend, op, lp, rp, wait_for)
            try:
                busy.first.wait(wait_for)  # the owner is serving: close now
                assert busy.settled, f"repetition {rep}: no {op.value} settled within {wait_for:g}s"
                owner.close_backend(scribble=True)
                time.sleep(CLOSE_GRACE)  # what a request served after close returned would land, lands now
                backend.remove_remote(name)  # ends the rest at once: a closed owner may be noticed only at the timeout
            finally:
                busy.stop(wait_for)
            if op is Op.WRITE:
                assert_bytes(far.read(), np.full(SLOW_BYTES, 0xFF, np.uint8),
                             f"repetition {rep}: the peer's memory, overwritten the instant its close returned "
                             "(a WRITE landed after close had returned: wait for the requests using the memory, "
                             "as deregister does)")
            else:
                got = near.read()
                late = np.flatnonzero((got != src) & (got != 0))
                assert not late.size, (
                    f"repetition {rep}: {late.size} bytes READ into this agent are neither the peer's data nor "
                    f"untouched, first at offset {late[0]}: a READ still read the peer's memory after its close "
                    "had returned (wait for the requests using it, as deregister does)")


class _Busy:
    """A thread posting ``op`` over the whole lists until ``stop``, up to
    ``window`` transfers in flight: keeps the owner serving requests."""

    def __init__(self, backend, op, lp, rp, wait_for, window=4):
        self.first, self._stop, self.settled, self.errors = threading.Event(), threading.Event(), 0, []
        self._in = ("transfer", time.monotonic())  # the backend call the thread is in, since when
        self._thread = threading.Thread(target=self._run, args=(backend, op, lp, rp, wait_for, window), daemon=True)
        self._thread.start()

    def _run(self, backend, op, lp, rp, wait_for, window):
        posted: list = []
        try:
            while posted or not self._stop.is_set():
                if len(posted) < window and not self._stop.is_set():
                    self._in = ("transfer", time.monotonic())
                    try:
                        posted.append(backend.transfer(op, lp, None, rp, None))
                    except KvtError:
                        pass  # refused at post once the memory is gone: as good
                    continue
                h = posted.pop(0)
                self._in = ("wait", time.monotonic())
                if backend.wait(h, wait_for).pending:
                    raise AssertionError(f"a {op.value} stayed PROC for {wait_for:g}s")
                self._in = ("release", time.monotonic())
                backend.release(h)
                self.settled += 1
                self.first.set()
        except BaseException as e:  # noqa: BLE001 - re-raised by stop() on the test's thread
            self.errors.append(e)
            self.first.set()

    def stop(self, timeout):
        self._stop.set()
        self._thread.join(timeout)
        call, since = self._in
        assert not self._thread.is_alive(), (
            f"the transfers were not all waited for and released {timeout:g}s after the last was posted: "
            f"the posting thread is in {call}(), for {time.monotonic() - since:.1f}s so far")
        if self.errors:
            raise self.errors[0]
