"""The ucx backend against a peer in another process (real UCX, real sockets)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import TIMEOUT
from kvt.errors import InvalidDescriptor, PeerDisconnected, RemoteRejected, TransferError, UnknownPeer
from kvt.types import Descs, Op
from ucx_peer import EXTRA, NBYTES, pattern, settle

pytestmark = pytest.mark.multiprocess

BLOCK = 4096
NBLK = NBYTES // BLOCK


def _setup(backend, peer, nbytes: int = NBYTES):
    """A registered local buffer, the peer loaded, and both sides prepped as blocks."""
    local = np.zeros(nbytes, np.uint8)
    backend.register(Descs.from_buffers([local]))
    name = backend.add_remote(peer.metadata())
    n = nbytes // BLOCK
    lp = backend.prep(None, Descs.from_blocks(local.ctypes.data, BLOCK, np.arange(n)))
    rp = backend.prep(name, Descs.from_blocks(peer.main_addr, BLOCK, np.arange(NBLK)))
    return local, name, lp, rp


def _done(backend, h):
    state = settle(backend, h, TIMEOUT + 10)
    assert state.done, state
    backend.release(h)


def _blocks(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1, BLOCK)


def test_read_scattered_blocks(backend, peer):
    want = _blocks(peer.fill(1))
    local, _, lp, rp = _setup(backend, peer)
    rng = np.random.default_rng(0)
    remote_ids, local_ids = rng.permutation(NBLK)[:100], rng.permutation(NBLK)[:100]
    _done(backend, backend.transfer(Op.READ, lp, local_ids, rp, remote_ids))
    got = _blocks(local)
    np.testing.assert_array_equal(got[local_ids], want[remote_ids])
    untouched = np.setdiff1d(np.arange(NBLK), local_ids)
    assert not got[untouched].any(), "READ wrote outside the requested blocks"


def test_write_scattered_blocks(backend, peer):
    local, _, lp, rp = _setup(backend, peer)
    local[:] = pattern(2, NBYTES)
    rng = np.random.default_rng(1)
    remote_ids, local_ids = rng.permutation(NBLK)[:100], rng.permutation(NBLK)[:100]
    _done(backend, backend.transfer(Op.WRITE, lp, local_ids, rp, remote_ids))
    main, _ = peer.contents()
    far = _blocks(main)
    np.testing.assert_array_equal(far[remote_ids], _blocks(local)[local_ids])
    assert not far[np.setdiff1d(np.arange(NBLK), remote_ids)].any(), "WRITE touched other blocks"


def _move_and_check(backend, peer, op: Op, local_ids, remote_ids, seed: int) -> None:
    """Fill the source side with ``pattern(seed)``, move the blocks with
    ``op``, and check that every destination block holds its source block."""
    want = pattern(seed, NBYTES)
    if op is Op.READ:
        peer.fill(seed)
    local, _, lp, rp = _setup(backend, peer)
    if op is Op.WRITE:
        local[:] = want
    _done(backend, backend.transfer(op, lp, local_ids, rp, remote_ids))
    if op is Op.READ:
        np.testing.assert_array_equal(_blocks(local)[local_ids], _blocks(want)[remote_ids])
    else:
        np.testing.assert_array_equal(_blocks(peer.contents()[0])[remote_ids], _blocks(want)[local_ids])


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_batch_mixes_staged_and_in_place_messages(make_backend, peer, op):
    """Many small blocks (packed into several staged messages) and long
    contiguous runs (sent in place) in one transfer; every byte lands."""
    backend = make_backend(zcopy_min=64 << 10, stage_max=32 << 10)  # small limits: several messages of each
    scattered = np.random.default_rng(2).permutation(NBLK // 2)[:64]  # single blocks
    runs = NBLK // 2 + np.arange(NBLK // 2)                             # 128 contiguous blocks: one long run
    ids = np.concatenate([scattered, runs])
    _move_and_check(backend, peer, op, ids, ids, seed=3)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_many_in_place_messages(make_backend, peer, op):
    """With ``zcopy_min=1`` every block is its own in-place message (the path
    device memory always takes): 200 messages posted at once, all land."""
    rng = np.random.default_rng(4)
    _move_and_check(make_backend(zcopy_min=1), peer, op, rng.permutation(NBLK)[:200],
                    rng.permutation(NBLK)[:200], seed=10)


def test_write_notification_arrives_after_its_data(backend, peer):
    local, _, lp, rp = _setup(backend, peer)
    local[:] = pattern(4, NBYTES)
    ids = np.arange(0, NBLK, 2)
    h = backend.transfer(Op.WRITE, lp, ids, rp, ids, notif=b"kv-ready")
    [(sender, msg, snapshot)] = peer.await_notifs(1)
    assert (sender, msg) == ("initiator", b"kv-ready")
    np.testing.assert_array_equal(_blocks(snapshot)[ids], _blocks(local)[ids],
                                  "the notification arrived before all of its data had landed")
    _done(backend, h)


def test_read_notification_reaches_the_target_after_completion(backend, peer):
    want = _blocks(peer.fill(5))
    local, _, lp, rp = _setup(backend, peer)
    ids = np.arange(10)
    h = backend.transfer(Op.READ, lp, ids, rp, ids, notif=b"read-done")
    [(sender, msg, _)] = peer.await_notifs(1)
    assert (sender, msg) == ("initiator", b"read-done")
    # the READ's data was here before the target heard of it
    np.testing.assert_array_equal(_blocks(local)[ids], want[ids])
    _done(backend, h)


def test_notify_messages_arrive_in_order(backend, peer):
    name = backend.add_remote(peer.metadata())
    msgs = [f"m{i}".encode() for i in range(20)]
    for m in msgs:
        backend.notify(name, m)
    assert [m for _, m, _ in peer.await_notifs(len(msgs))] == msgs


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_target_refuses_memory_it_no_longer_registers(backend, peer, op):
    """The target checks every range itself: the initiator's metadata says
    ``extra`` is registered, the target has withdrawn it -> RemoteRejected,
    the target's memory untouched, and it goes on serving."""
    local = np.full(NBYTES, 9, np.uint8)
    backend.register(Descs.from_buffers([local]))
    name = backend.add_remote(peer.metadata())
    lp = backend.prep(None, Descs.from_regions([local.ctypes.data], [EXTRA]))
    rp = backend.prep(name, Descs.from_regions([peer.extra_addr], [EXTRA]))
    peer.withdraw_extra()
    state = settle(backend, backend.transfer(op, lp, None, rp, None), TIMEOUT + 10)
    assert state.failed and isinstance(state.cause, RemoteRejected), state
    assert "outside memory this agent registered" in str(state.cause)
    main, extra = peer.contents()
    assert not extra.any() and not main.any(), "a refused request touched the target's memory"
    if op is Op.READ:
        assert (local == 9).all(), "a refused READ wrote into the initiator's buffer"
    # still serving
    want = _blocks(peer.fill(6))
    local2, _, lp2, rp2 = _setup(backend, peer)
    _done(backend, backend.transfer(Op.READ, lp2, [0, 1], rp2, [7, 8]))
    assert np.array_equal(_blocks(local2)[[0, 1]], want[[7, 8]])


def test_prep_outside_the_peers_registrations_is_refused_before_any_byte_moves(backend, peer):
    name = backend.add_remote(peer.metadata())
    with pytest.raises(InvalidDescriptor):
        backend.prep(name, Descs.from_regions([peer.main_addr + NBYTES - 10], [20]))


def test_unknown_peers(backend, peer):
    with pytest.raises(UnknownPeer):
        backend.prep("nobody", Descs.from_regions([4096], [8]))
    with pytest.raises(UnknownPeer):
        backend.notify("nobody", b"x")
    with pytest.raises(UnknownPeer):
        backend.remove_remote("nobody")
    name = backend.add_remote(peer.metadata())
    backend.remove_remote(name)
    with pytest.raises(UnknownPeer):
        backend.notify(name, b"x")


def test_peer_death_ends_in_flight_transfers_and_the_agent_serves_others(backend, peer, spawn_peer):
    local, name, lp, rp = _setup(backend, peer)
    ids = np.arange(NBLK)
    peer.freeze()  # surely in flight when it dies
    posted = [backend.transfer(op, lp, ids, rp, ids) for op in (Op.READ, Op.WRITE)]
    time.sleep(0.2)
    assert all(backend.check_state(h).pending for h in posted)
    start = time.monotonic()
    peer.kill()
    for h in posted:
        state = settle(backend, h, TIMEOUT + 5)
        assert state.failed and isinstance(state.cause, PeerDisconnected), state
    assert time.monotonic() - start < TIMEOUT, "death was not detected before the timeout"
    assert not local.any(), "bytes arrived from a peer that was frozen, then killed"
    # the dead peer stays dead for new transfers
    state = settle(backend, backend.transfer(Op.READ, lp, [0], rp, [0]), TIMEOUT + 5)
    assert state.failed and isinstance(state.cause, TransferError)
    # and another peer is served as before
    other = spawn_peer("other")
    want = _blocks(other.fill(7))
    oname = backend.add_remote(other.metadata())
    orp = backend.prep(oname, Descs.from_blocks(other.main_addr, BLOCK, np.arange(NBLK)))
    _done(backend, backend.transfer(Op.READ, lp, [3], orp, [5]))
    np.testing.assert_array_equal(_blocks(local)[3], want[5])


def test_frozen_peer_times_out(make_backend, peer):
    backend = make_backend(timeout=1.0)
    _, _, lp, rp = _setup(backend, peer)
    peer.freeze()
    try:
        start = time.monotonic()
        state = settle(backend, backend.transfer(Op.READ, lp, [0], rp, [0]), 10)
        assert state.failed and isinstance(state.cause, TimeoutError), state
        assert time.monotonic() - start < 5
    finally:
        peer.thaw()


def test_remove_remote_ends_in_flight_transfers(backend, peer):
    _, name, lp, rp = _setup(backend, peer)
    peer.freeze()
    try:
        h = backend.transfer(Op.READ, lp, None, rp, None)
        backend.remove_remote(name)
        state = settle(backend, h, TIMEOUT + 5)
        assert state.failed and isinstance(state.cause, PeerDisconnected), state
    finally:
        peer.thaw()


def test_target_survives_an_initiator_that_dies(backend, spawn_peer):
    """A peer starts a WRITE into us and is killed at once: we drop its
    half-served request within the timeout and serve the next initiator."""
    local = np.zeros(NBYTES, np.uint8)
    backend.register(Descs.from_buffers([local]))
    victim = spawn_peer("victim")
    victim.fill(9)
    victim.write_to(backend.local_metadata(), local.ctypes.data)
    victim.kill()
    engine = backend._engine  # the service records are the observable here
    deadline = time.monotonic() + TIMEOUT + 5
    while engine._services and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine._services, "a dead initiator's request was never dropped"
    other = spawn_peer("other")
    want = _blocks(other.fill(8))
    name = backend.add_remote(other.metadata())
    lp = backend.prep(None, Descs.from_blocks(local.ctypes.data, BLOCK, np.arange(NBLK)))
    rp = backend.prep(name, Descs.from_blocks(other.main_addr, BLOCK, np.arange(NBLK)))
    _done(backend, backend.transfer(Op.READ, lp, np.arange(NBLK), rp, np.arange(NBLK)))
    np.testing.assert_array_equal(_blocks(local), want)
