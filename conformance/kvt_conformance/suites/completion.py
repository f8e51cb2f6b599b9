"""Completion: PROC until DONE and never DONE before every byte is at the
destination; DONE stays DONE; release, release twice, release in flight."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvt.agent import poll_until
from kvt.errors import InvalidDescriptor, KvtTimeoutError
from kvt.types import MemKind, Op, Status, is_settled

from ..buffers import Buffer
from ..fixtures import BackendFixtures, expect_done, settle, settle_all
from ..requirements import requires
from ._common import (CONTRACT_REPEATS, SLOW_BLOCK, SLOW_BYTES, assert_bytes, assert_released, contract_setup,
                      contract_source, destination, expected, moved, scattered, seeds)


#: transfers of the memory under way when it is deregistered
DEREGISTERED_INFLIGHT = 4


class CompletionTests(BackendFixtures):
    area = "completion"
    block = 4096
    nblocks = 64

    def _post(self, backend, local_buffer, far_buffer, op, kind=MemKind.DRAM):
        size = self.block * self.nblocks
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, kind, ns), far_buffer(size, kind, fs)
        ids = np.arange(self.nblocks)
        lp, rp = backend.prep(None, near.blocks(self.block, ids)), backend.prep(peer, far.blocks(self.block, ids[::-1]))
        want = expected(op, size, self.block, ids, ids[::-1])
        return backend.transfer(op, lp, None, rp, None), destination(op, near, far), want

    def test_never_done_before_the_data(self, backend, local_buffer, far_buffer, op, where, kind, wait_for):
        """Poll as fast as possible; the moment DONE is seen, the destination
        must already hold every byte (at once for a transfer that came back
        ``SETTLED``)."""
        handle, dst, want = self._post(backend, local_buffer, far_buffer, op, kind)
        if is_settled(handle):
            assert_bytes(dst.read(), want, "destination when transfer() returned SETTLED")
        seen: list[Status] = []

        def settled():
            state = backend.check_state(handle)
            seen.append(state.status)
            return None if state.pending else state

        try:
            state = poll_until(settled, wait_for, "transfer")
        except KvtTimeoutError:
            pytest.fail(f"transfer still PROC after {wait_for:g}s")
        got = dst.read()  # first thing after DONE
        assert state.done, f"transfer ended {state!r}"
        assert_bytes(got, want, "destination when DONE was first reported")
        assert set(seen[:-1]) <= {Status.PROC}, f"states before DONE: {sorted(set(seen[:-1]))}"

    def test_done_stays_done(self, backend, local_buffer, far_buffer, op, where, wait_for):
        handle, _, _ = self._post(backend, local_buffer, far_buffer, op)
        expect_done(backend, handle, wait_for)
        for _ in range(5):
            assert backend.check_state(handle).done

    def test_release_after_done_and_twice(self, backend, local_buffer, far_buffer, op, where, wait_for):
        handle, dst, want = self._post(backend, local_buffer, far_buffer, op)
        expect_done(backend, handle, wait_for)
        backend.release(handle)
        assert_released(backend, handle)
        assert_bytes(dst.read(), want)

    def test_release_in_flight(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """Releasing a transfer that may still be running returns, and the
        backend goes on serving the next transfer correctly."""
        handle, _, _ = self._post(backend, local_buffer, far_buffer, op)
        backend.release(handle)
        assert_released(backend, handle)
        again, dst, want = self._post(backend, local_buffer, far_buffer, op)
        expect_done(backend, again, wait_for)
        assert_bytes(dst.read(), want)

    def test_released_transfer_lands_nothing_later(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """Once ``release`` returns, no byte of the transfer lands any more
        (an engine hands the memory of an aborted load to the next request at
        once).  The transfer is released as soon as it is seen moving; the
        destination is then copied, a later transfer with the same peer is
        awaited, and the destination must still be that copy."""
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(SLOW_BYTES, seed=ns), far_buffer(SLOW_BYTES, seed=fs)
        # the barrier: a small transfer between two other buffers, with the same peer
        bn, (_, bf) = local_buffer(SLOW_BLOCK, seed=ns), far_buffer(SLOW_BLOCK, seed=fs)
        every = np.arange(SLOW_BYTES // SLOW_BLOCK)
        lp, rp = backend.prep(None, near.blocks(SLOW_BLOCK, every)), backend.prep(peer, far.blocks(SLOW_BLOCK, every))
        blp, brp = backend.prep(None, bn.blocks(SLOW_BLOCK, [0])), backend.prep(peer, bf.blocks(SLOW_BLOCK, [0]))
        dst = destination(op, near, far)
        # a destination in this process is watched as the bytes arrive: the first bytes of every block
        watch = dst.mem.reshape(-1, SLOW_BLOCK)[:, :8] if isinstance(dst, Buffer) else None
        for rep in range(CONTRACT_REPEATS):
            if isinstance(dst, Buffer):  # not the source's bytes, so that what lands shows
                dst.fill(5000 + rep)
            else:
                dst.peer.fill_blocks(dst.key, SLOW_BLOCK, every.tolist(), 5000 + rep)
            before = None if watch is None else watch.copy()
            handle = backend.transfer(op, lp, None, rp, None)
            deadline = time.monotonic() + wait_for
            while watch is not None and time.monotonic() < deadline and backend.check_state(handle).pending \
                    and np.array_equal(watch, before):
                pass  # spin until it is seen moving (or is over)
            backend.release(handle)
            after_release = dst.read()
            expect_done(backend, backend.transfer(op, blp, None, brp, None), wait_for)
            assert_bytes(dst.read(), after_release,
                         f"repetition {rep}: {op.value} destination after release returned and a later transfer "
                         "with the same peer completed (bytes of the released transfer landed after release "
                         "returned: wait for or cancel it before returning)")

    def test_releasing_preps_leaves_their_transfers_alone(self, backend, local_buffer, far_buffer, op, where,
                                                          wait_for):
        """Releasing a prep handle forgets the list; transfers already posted
        from it are unaffected (docs/plugin-guide.md, "release"): both preps
        of a transfer of 8 MiB in 16,384 rows are released the moment it is
        posted, and it must still end DONE with every byte moved.  Three
        times, with new preps each."""
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(SLOW_BYTES, seed=ns), far_buffer(SLOW_BYTES, seed=fs)
        every = np.arange(SLOW_BYTES // SLOW_BLOCK)
        want = expected(op, SLOW_BYTES, SLOW_BLOCK, every, every[::-1])
        dst = destination(op, near, far)
        for rep in range(3):
            lp, rp = backend.prep(None, near.blocks(SLOW_BLOCK, every)), backend.prep(peer, far.blocks(SLOW_BLOCK, every[::-1]))
            handle = backend.transfer(op, lp, None, rp, None)
            backend.release(lp)
            backend.release(rp)
            state = settle(backend, handle, wait_for)
            assert state.done, (f"repetition {rep}: a {op.value} whose preps were released right after it was posted "
                                f"ended {state!r}; releasing a prep must not affect transfers posted from it")
            backend.release(handle)
            assert_bytes(dst.read(), want, f"repetition {rep}: {op.value} destination after its preps were released")

    def test_deregister_stops_our_transfers_of_that_memory(self, backend, local_buffer, far_buffer, op, where,
                                                            wait_for):
        """``deregister`` of our memory that our own transfers still move
        returns only once none of them touches it (each has landed or ends
        ERR): the caller frees it next.  Transfers of 32 MiB in 65,536 rows
        (more than a backend copies at post) are posted, the memory is
        deregistered at once and, the instant that returns, overwritten as
        freed and reused memory would be: no READ may land on the overwrite
        and no WRITE carry it off.  A transfer posted later with a prep of
        that memory is refused with ``InvalidDescriptor``."""
        ns, fs = seeds(op)
        nbytes = 4 * SLOW_BYTES
        near, (peer, far) = local_buffer(nbytes, seed=ns, register=False), far_buffer(nbytes, seed=fs)
        key = backend.register(near.region())
        every = np.arange(nbytes // SLOW_BLOCK)
        lp, rp = backend.prep(None, near.blocks(SLOW_BLOCK, every)), backend.prep(peer, far.blocks(SLOW_BLOCK, every))
        handles = [backend.transfer(op, lp, None, rp, None) for _ in range(DEREGISTERED_INFLIGHT)]
        backend.deregister(key)
        near.fill_byte(0xFF)
        far_then = _read(far, nbytes)
        settle_all(backend, [h for h in handles if not is_settled(h)], wait_for)  # DONE or ERR: either
        why = "end or wait for this backend's transfers of that memory before returning"
        _assert_untouched(op, near, far, far_then, nbytes, f"after deregister returned ({why})")
        try:
            h = backend.transfer(op, lp, None, rp, None)
        except InvalidDescriptor:
            return
        state = settle(backend, h, wait_for)
        assert state.failed, (f"a {op.value} posted with a prep of memory deregistered since ended {state!r}; "
                              "refuse it (InvalidDescriptor at post, or ERR)")
        _assert_untouched(op, near, far, far_then, nbytes, "by a transfer posted with a prep of it")

    @requires("local", "READ")
    def test_handles_are_distinct(self, backend, local_buffer, wait_for):
        src, dst = local_buffer(1024, seed=1), local_buffer(1024)
        sp, dp = backend.prep(None, src.blocks(64, range(16))), backend.prep(None, dst.blocks(64, range(16)))
        handles = [backend.transfer(Op.READ, dp, [i], sp, [i]) for i in range(16)]
        live = [h for h in handles if not is_settled(h)]  # SETTLED is no handle: any number may come back
        assert len(set(live)) == len(live), "two live transfers share a handle"
        for h in handles:
            expect_done(backend, h, wait_for)
        assert_bytes(dst.read(), src.read())

    def test_done_means_every_byte_landed_at_the_peer(self, backend, local_buffer, peer, op, wait_for):
        """Many scattered blocks to or from the peer, repeated; the initiator
        polls without sleeping and, the first time it sees DONE, the
        destination is checked: this agent's memory for a READ, the peer's
        (the target's) for a WRITE.  DONE means the last byte landed, not
        that the request was sent."""
        near, far, lp, rp = contract_setup(backend, local_buffer, peer)
        for rep in range(CONTRACT_REPEATS):
            near_ids, far_ids = scattered(100 + rep)
            src = contract_source(op, near, far, peer, 3000 + rep)
            want = moved(src, near_ids, far_ids) if op is Op.WRITE else moved(src, far_ids, near_ids)
            handle = backend.transfer(op, lp, near_ids, rp, far_ids)
            deadline = time.monotonic() + wait_for
            state = backend.check_state(handle)
            while state.pending and time.monotonic() < deadline:  # spin: no sleep
                state = backend.check_state(handle)
            got = (near if op is Op.READ else far).read()  # first thing after DONE
            assert not state.pending, f"repetition {rep}: {op.value} still PROC after {wait_for:g}s"
            assert state.done, f"repetition {rep}: {op.value} ended {state!r}, expected DONE"
            assert_bytes(got, want, f"repetition {rep}: {'this agent' if op is Op.READ else 'the peer'}'s "
                         f"memory when the {op.value} first reported DONE (report DONE only once the last byte "
                         "landed at the destination, e.g. after the target acknowledged a WRITE)")
            backend.release(handle)


def _assert_untouched(op: Op, near, far, far_then: np.ndarray, nbytes: int, when: str) -> None:
    """Deregistered ``near`` (overwritten with 0xFF) received no READ, and
    ``far`` got none of it by WRITE."""
    if op is Op.READ:
        late = np.flatnonzero(near.read() != 0xFF)
        assert not late.size, (f"{late.size} bytes landed in deregistered memory {when}, first at offset {late[0]}")
    else:
        assert_bytes(_read(far, nbytes), far_then, f"a WRITE's destination: the WRITE read deregistered memory {when}")


def _read(buf, nbytes: int) -> np.ndarray:
    """``buf``'s bytes, read a ``SLOW_BYTES`` piece at a time (a peer answers up to 16 MiB per message)."""
    return np.concatenate([buf.read(off, min(SLOW_BYTES, nbytes - off)) for off in range(0, nbytes, SLOW_BYTES)])
