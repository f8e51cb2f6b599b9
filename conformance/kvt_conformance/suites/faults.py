"""Faults: a peer process frozen, killed mid-transfer or gone; a handshake
with nobody there.  Transfers end in ERR (with a ``TransferError`` cause)
within the backend's ``timeout``, nothing hangs, and the agent goes on
serving its other peers.

These tests run their backends with ``timeout = fault_timeout`` (5 s) so a
missed detection shows up quickly.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
from kvt.errors import HandshakeTimeout, KvtError, TransferError
from kvt.handshake import request
from kvt.types import Op

from ..buffers import pattern
from ..fixtures import BackendFixtures, expect_done, settle, settle_all
from ..requirements import requires
from ._common import SLOW_BLOCK, SLOW_BYTES, assert_bytes

BLOCK, N = 4096, 64
#: transfers queued to an in-process peer when it is removed
QUEUED = 4


class FaultTests(BackendFixtures):
    area = "faults"
    #: the ``timeout`` option of every backend these tests create
    fault_timeout: ClassVar[float] = 5.0

    @pytest.fixture
    def backend(self, make_backend):
        return make_backend(timeout=self.fault_timeout)

    @pytest.fixture
    def wait_for(self) -> float:
        """Detection must happen within the timeout; the slack covers a loaded machine."""
        return self.fault_timeout * 1.5 + 3.0

    def _victim(self, backend, spawn_peer):
        """A dedicated peer with a registered, filled buffer, loaded by ``backend``."""
        victim = spawn_peer(timeout=self.fault_timeout)
        buf = victim.alloc(BLOCK * N, seed=7)
        return victim, buf, backend.add_remote(victim.metadata())

    def _ops(self, target):
        return [op for op in Op if op in target.caps.ops]

    def _expect_refused(self, backend, target, lp, rp, ids, wait_for, who):
        """Every declared op to ``who`` fails: a kvt error when posting, or ERR
        (with a TransferError cause) within the timeout, all at once."""
        posted = []
        for op in self._ops(target):
            try:
                posted.append((op, backend.transfer(op, lp, ids, rp, ids)))
            except KvtError:
                pass
        for (op, _), state in zip(posted, settle_all(backend, [h for _, h in posted], wait_for)):
            assert state.failed, f"{op.value} to {who} ended {state!r}"
            assert isinstance(state.cause, TransferError), f"ERR cause {state.cause!r} is not a TransferError"

    @requires("remote")
    def test_peer_killed_mid_transfer(self, backend, local_buffer, spawn_peer, peer, target, wait_for):
        victim, vbuf, vname = self._victim(backend, spawn_peer)
        near = local_buffer(BLOCK * N, seed=8)
        ids = np.arange(N)
        lp, rp = backend.prep(None, near.blocks(BLOCK, ids)), backend.prep(vname, vbuf.blocks(BLOCK, ids))
        chunks = np.array_split(ids, 4)
        victim.stop()  # frozen first, so the transfers are surely in flight when it dies
        posted = [(op, c, backend.transfer(op, lp, c, rp, c)) for op in self._ops(target) for c in chunks]
        time.sleep(0.2)
        victim.kill()
        want = pattern(7, BLOCK * N).reshape(N, BLOCK)
        states = settle_all(backend, [h for _, _, h in posted], wait_for)  # all within one timeout
        for (op, chunk, _), state in zip(posted, states):
            if state.failed:
                assert isinstance(state.cause, TransferError), f"ERR cause {state.cause!r} is not a TransferError"
            elif op is Op.READ:  # it finished before the kill: then the data must be there
                assert_bytes(near.read().reshape(N, BLOCK)[chunk], want[chunk], "READ reported DONE")
        # the peer is certainly dead now: a new transfer must fail, not report stale success
        self._expect_refused(backend, target, lp, rp, chunks[0], wait_for, "a dead peer")
        self._still_serves(backend, local_buffer, peer, target, wait_for)

    def _still_serves(self, backend, local_buffer, peer, target, wait_for):
        op = self._ops(target)[0]
        far = peer.alloc(BLOCK * 4, seed=9 if op is Op.READ else None)
        near = local_buffer(BLOCK * 4, seed=None if op is Op.READ else 9)
        name = backend.add_remote(peer.metadata())
        lp, rp = backend.prep(None, near.blocks(BLOCK, range(4))), backend.prep(name, far.blocks(BLOCK, range(4)))
        expect_done(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        assert_bytes(near.read(), far.read(), "transfer with a healthy peer after the fault")
        if target.caps.notifications:
            backend.notify(name, b"still here")
            assert peer.take_notifs(backend.agent_name, 1, wait_for) == [b"still here"]

    @requires("remote")
    def test_transfer_posts_while_peer_frozen(self, backend, local_buffer, spawn_peer, target, wait_for):
        """``transfer`` returns without waiting for a peer that does not answer;
        the transfer completes once the peer runs again."""
        victim, vbuf, vname = self._victim(backend, spawn_peer)
        op = self._ops(target)[0]
        near = local_buffer(BLOCK * N, seed=None if op is Op.READ else 8)
        ids = np.arange(N)
        lp, rp = backend.prep(None, near.blocks(BLOCK, ids)), backend.prep(vname, vbuf.blocks(BLOCK, ids))
        posted: list = []
        victim.stop()
        try:
            poster = threading.Thread(target=lambda: posted.append(backend.transfer(op, lp, None, rp, None)),
                                      daemon=True)
            poster.start()
            poster.join(0.8 * self.fault_timeout)  # a blocking transfer() would wait out the timeout
            assert posted, "transfer() blocked while the peer was not answering; it must return at once"
        finally:
            victim.resume()
        expect_done(backend, posted[0], wait_for)
        assert_bytes(near.read(), vbuf.read())

    def _far_pair(self, make_backend, spawn_peer, local_buffer, target, op):
        """A backend and a peer process, both built with the backend's
        ``cross_host_options`` (so a stopped peer really stalls a transfer),
        ``N`` blocks each, the source side seeded, both lists prepped:
        ``(backend, victim, near, vbuf, vname, lp, rp)``."""
        read, opts = op is Op.READ, dict(target.caps.cross_host_options)
        backend = make_backend(timeout=self.fault_timeout, **opts)
        victim = spawn_peer(timeout=self.fault_timeout, **opts)
        vbuf, vname = victim.alloc(BLOCK * N, seed=7 if read else None), backend.add_remote(victim.metadata())
        near = local_buffer(BLOCK * N, seed=None if read else 7, owner=backend)
        lp, rp = backend.prep(None, near.blocks(BLOCK, range(N))), backend.prep(vname, vbuf.blocks(BLOCK, range(N)))
        return backend, victim, near, vbuf, vname, lp, rp

    @requires("remote")
    def test_frozen_peer_fails_every_queued_transfer_within_one_timeout(self, make_backend, local_buffer,
                                                                        spawn_peer, target, wait_for):
        """A peer that stops answering (frozen, never killed: no socket is
        reset) fails every transfer queued to it within one ``timeout``, not
        one per timeout, and a transfer posted after that fails at once
        (until ``add_remote`` loads the peer again).  Both sides on the
        backend's ``cross_host_options``, so the stopped peer stalls them."""
        op = self._ops(target)[0]
        backend, victim, near, vbuf, vname, lp, rp = self._far_pair(make_backend, spawn_peer, local_buffer, target, op)
        chunks = np.array_split(np.arange(N), QUEUED)
        victim.stop()
        try:
            t0 = time.monotonic()
            handles = [backend.transfer(op, lp, c, rp, c) for c in chunks]
            states = settle_all(backend, handles, wait_for)
            took = time.monotonic() - t0
            if not any(s.failed for s in states):
                pytest.skip(f"the {op.value}s completed with the peer stopped, even with "
                            f"{dict(target.caps.cross_host_options)}: nothing stalled")
            assert all(s.failed and isinstance(s.cause, TransferError) for s in states), (
                f"with the peer frozen, {QUEUED} queued {op.value}s ended {states!r}: each must end ERR "
                "(a TransferError cause)")
            start = time.monotonic()
            try:
                late = settle(backend, backend.transfer(op, lp, chunks[0], rp, chunks[0]), wait_for)
            except KvtError:  # refused when posting: as good as failing at once
                late = None
            quick = time.monotonic() - start
        finally:
            victim.resume()
        assert late is None or late.failed, f"a {op.value} to the peer that timed out ended {late!r}"
        assert quick < self.fault_timeout / 2, (
            f"a {op.value} posted after the peer timed out took {quick:.1f}s to fail (the backend's timeout is "
            f"{self.fault_timeout:g}s): fail transfers to a timed-out peer at once until add_remote loads it "
            f"again (the {QUEUED} queued ones took {took:.1f}s)")

    @requires("remote")
    def test_check_state_returns_while_peer_frozen(self, make_backend, local_buffer, spawn_peer, target, wait_for):
        """``check_state`` is a poll: it never blocks long, even while the
        peer does not answer.  With the peer stopped (both sides on the
        backend's ``cross_host_options``, so the transfer really waits for
        it), every ``check_state`` over a second must return within a
        quarter of the backend's ``timeout``; one that waits for the
        transfer to settle takes the whole timeout."""
        op = self._ops(target)[0]
        backend, victim, near, vbuf, vname, lp, rp = self._far_pair(make_backend, spawn_peer, local_buffer, target, op)
        bound, calls, slowest = self.fault_timeout / 4, 0, 0.0
        victim.stop()
        try:
            handle = backend.transfer(op, lp, None, rp, None)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                start = time.monotonic()
                state = backend.check_state(handle)
                slowest, calls = max(slowest, time.monotonic() - start), calls + 1
                if not state.pending:
                    break
                time.sleep(0.01)
        finally:
            victim.resume()
        assert slowest < bound, (
            f"a check_state took {slowest:.2f}s while the peer was stopped (the backend's timeout is "
            f"{self.fault_timeout:g}s; {calls} calls): check_state polls, it never waits for the transfer")
        settle(backend, handle, wait_for)  # and the transfer still ends

    @requires("remote", "READ", "stops_on_err")
    def test_remote_read_ended_in_err_writes_nothing_later(self, make_backend, local_buffer, spawn_peer, target,
                                                          wait_for):
        """A READ from a peer that stopped answering ends in ERR, and once it
        has, no byte of it lands in local memory, even when the peer runs
        again: an engine reuses the memory of a failed load at once (vLLM
        gives the blocks to the next request).  Run with the backend's
        ``cross_host_options``, so that a stopped peer stalls the READ on one
        host too (same-host shortcuts read a stopped process's memory)."""
        near, _ = self._ended_in_err(Op.READ, make_backend, local_buffer, spawn_peer, target, wait_for)
        assert not near.read().any(), "bytes of a READ that had ended in ERR landed after it had"

    @requires("remote", "WRITE", "stops_on_err")
    def test_remote_write_ended_in_err_lands_nothing_later(self, make_backend, local_buffer, spawn_peer, target,
                                                           wait_for):
        """The WRITE side of the test above: a WRITE to a peer that stopped
        answering ends in ERR, and once it has, no byte of it lands in the
        peer's memory, even when the peer runs again: the peer may have given
        those blocks to another request.  Both sides use the backend's
        ``cross_host_options``, so nothing moves into the stopped peer at all:
        whatever its buffer holds once it runs again arrived after the ERR.
        This side's buffer is overwritten at the ERR (an engine reuses it), so
        a transport that reads it late is caught too."""
        _, far = self._ended_in_err(Op.WRITE, make_backend, local_buffer, spawn_peer, target, wait_for)
        late = np.flatnonzero(far.read())
        assert not late.size, (f"{late.size} bytes of a WRITE that had ended in ERR landed in the peer after it had "
                               f"(first at offset {late[0]}); end the transfer so that none can (stops_on_err)")

    def _ended_in_err(self, op, make_backend, local_buffer, spawn_peer, target, wait_for):
        """``op`` over N blocks with a peer process stopped, both sides on the
        backend's ``cross_host_options``: it must end ERR (skip if it
        completed).  Then this side's buffer is overwritten (an engine reuses
        it at once), the transfer released, the peer resumed, and a late
        transfer given every chance to land.  Returns (this side's buffer,
        the peer's), the first zeroed after a READ, the second untouched
        before a WRITE."""
        read = op is Op.READ
        backend, victim, near, vbuf, vname, lp, rp = self._far_pair(make_backend, spawn_peer, local_buffer, target, op)
        victim.stop()
        try:
            h = backend.transfer(op, lp, None, rp, None)
            state = settle(backend, h, wait_for)
            if state.done:
                pytest.skip(f"the {op.value} completed with the peer stopped, even with "
                            f"{dict(target.caps.cross_host_options)}: nothing stalled")
            assert isinstance(state.cause, TransferError), state
            # what landed before the ERR is allowed: a READ's destination zeroed, a WRITE's source changed
            near.write(np.zeros(BLOCK * N, np.uint8) if read else np.full(BLOCK * N, 0xA5, np.uint8))
            backend.release(h)
        finally:
            victim.resume()
        # the peer answers again: transfers with it progress the backend (re-added: it may have
        # been given up), into a spare buffer of the peer's, so the checked ones stay as they are
        other, spare = local_buffer(BLOCK, owner=backend), victim.alloc(BLOCK)
        name = backend.add_remote(victim.metadata())
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                settle(backend, backend.transfer(op, backend.prep(None, other.blocks(BLOCK, [0])), None,
                                                 backend.prep(name, spare.blocks(BLOCK, [0])), None), wait_for)
            except KvtError:
                pass
            time.sleep(0.1)
        return near, vbuf

    def test_remove_remote_ends_in_flight_transfers(self, backend, make_backend, local_buffer, spawn_peer, target,
                                                    request, wait_for):
        """``remove_remote`` forgets a peer and its in-flight transfers end in
        ERR (with a ``TransferError`` cause), even if the peer would answer
        them next.  With ``remote``: a peer process is stopped (both sides on
        the backend's ``cross_host_options``, so nothing moves meanwhile), a
        transfer posted, the peer removed and then resumed: the transfer must
        end ERR, not complete now that the peer answers.  Without: transfers
        of 8 MiB in 16,384 rows are queued to an in-process peer and it is
        removed while the last is still PROC: that one must end ERR."""
        op = self._ops(target)[0]
        if not target.caps.remote:
            self._remove_local_peer_with_transfers_queued(backend, local_buffer, request.getfixturevalue("peer"),
                                                          op, wait_for)
            return
        backend, victim, near, vbuf, vname, lp, rp = self._far_pair(make_backend, spawn_peer, local_buffer, target, op)
        victim.stop()
        try:
            handle = backend.transfer(op, lp, None, rp, None)
            if backend.check_state(handle).done:
                pytest.skip(f"the {op.value} completed with the peer stopped, even with "
                            f"{dict(target.caps.cross_host_options)}: nothing was in flight")
            backend.remove_remote(vname)
        finally:
            victim.resume()
        state = settle(backend, handle, wait_for)
        assert state.failed, (
            f"a {op.value} in flight to a peer when remove_remote forgot it ended {state!r} once the peer ran again; "
            "remove_remote ends the peer's in-flight transfers in ERR")
        assert isinstance(state.cause, TransferError), f"ERR cause {state.cause!r} is not a TransferError"

    def _remove_local_peer_with_transfers_queued(self, backend, local_buffer, peer, op, wait_for):
        near = local_buffer(SLOW_BYTES, seed=None if op is Op.READ else 7)
        far = peer.alloc(SLOW_BYTES, seed=7 if op is Op.READ else None)
        name = backend.add_remote(peer.metadata())
        ids = np.arange(SLOW_BYTES // SLOW_BLOCK)
        lp, rp = backend.prep(None, near.blocks(SLOW_BLOCK, ids)), backend.prep(name, far.blocks(SLOW_BLOCK, ids))
        handles = [backend.transfer(op, lp, None, rp, None) for _ in range(QUEUED)]
        last_pending = backend.check_state(handles[-1]).pending
        backend.remove_remote(name)
        if not last_pending:
            pytest.skip(f"{QUEUED} transfers of {SLOW_BYTES} bytes were all over before remove_remote: "
                        "nothing was in flight")
        states = settle_all(backend, handles, wait_for)
        for i, state in enumerate(states):
            if state.failed:
                assert isinstance(state.cause, TransferError), f"transfer {i}: ERR cause {state.cause!r} is not a " \
                                                               "TransferError"
        assert states[-1].failed, (
            f"the last of {QUEUED} {op.value}s queued to a peer, still PROC when remove_remote forgot the peer, "
            f"ended {states[-1]!r}; remove_remote ends the peer's in-flight transfers in ERR")

    @requires("remote")
    def test_transfer_to_exited_peer(self, backend, local_buffer, spawn_peer, peer, target, wait_for):
        victim, vbuf, vname = self._victim(backend, spawn_peer)
        near = local_buffer(BLOCK * N)
        lp, rp = backend.prep(None, near.blocks(BLOCK, range(N))), backend.prep(vname, vbuf.blocks(BLOCK, range(N)))
        victim.close()
        assert not victim.alive()
        self._expect_refused(backend, target, lp, rp, None, wait_for, "an exited peer")
        assert not near.read().any(), "bytes arrived from a peer that had exited"
        self._still_serves(backend, local_buffer, peer, target, wait_for)

    def test_handshake_with_nobody_there(self, backend):
        with socket.socket() as s:  # a port that was free a moment ago: nobody listens there
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            request(f"tcp://127.0.0.1:{port}", backend.local_metadata(), 1.0)
        assert time.monotonic() - start < 1.0 + 4.0, "the handshake outlived its timeout"

    @requires("remote")
    def test_handshake_with_frozen_peer(self, backend, spawn_peer):
        victim = spawn_peer(timeout=self.fault_timeout)
        endpoint = victim.serve_metadata()
        victim.stop()
        try:
            with pytest.raises(HandshakeTimeout):
                request(endpoint, backend.local_metadata(), 1.0)
        finally:
            victim.resume()
        assert isinstance(backend.add_remote(request(endpoint, b"again", 30.0)), str)  # it answers once resumed
