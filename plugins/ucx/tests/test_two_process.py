"""The ucx backend against a peer in another process (real UCX, real sockets)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from conftest import TIMEOUT
from kvt.errors import InvalidDescriptor, PeerDisconnected, RemoteRejected, TransferError, UnknownPeer
from kvt.types import Descs, Op
from ucx_peer import BIG, EXTRA, NBYTES, SHM_ONLY, TCP_ONLY, pattern, settle

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
def test_batch_of_scattered_blocks_and_a_long_run(backend, peer, op):
    """Single blocks and a contiguous run (merged into one RMA operation) in
    one transfer; every byte lands."""
    scattered = np.random.default_rng(2).permutation(NBLK // 2)[:64]
    runs = NBLK // 2 + np.arange(NBLK // 2)
    ids = np.concatenate([scattered, runs])
    _move_and_check(backend, peer, op, ids, ids, seed=3)


SPLIT = 64 * 1024  # split_bytes small enough that requests on these 1 MiB buffers run on two lanes
_SHAPES = {
    "one-run": lambda: np.arange(NBLK),  # one run: the middle cuts it
    "scattered": lambda: np.random.default_rng(11).permutation(NBLK)[:200],  # the middle falls between runs
    "mixed": lambda: np.concatenate([np.random.default_rng(12).permutation(NBLK // 2)[:40],
                                     NBLK // 2 + np.arange(NBLK // 2)]),
}


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_split_requests_move_every_byte_and_nothing_else(make_backend, peer, op, shape):
    """Same-host requests of at least ``split_bytes`` are cut in two: the
    helper's worker moves the first half while the caller moves the rest.
    Every byte lands, nothing outside the request is touched."""
    backend = make_backend(split_bytes=SPLIT)
    local, name, lp, rp = _setup(backend, peer)
    assert backend._peers[name].ep.lanes() == 2, "a same-host cma peer gets the second lane"
    ids = _SHAPES[shape]()
    remote_ids = np.random.default_rng(13).permutation(NBLK)[:len(ids)] if shape == "scattered" else ids
    want = pattern(20, NBYTES)
    if op is Op.READ:
        peer.fill(20)
    else:
        local[:] = want
    _done(backend, backend.transfer(op, lp, ids, rp, remote_ids))
    if op is Op.READ:
        got = _blocks(local)
        np.testing.assert_array_equal(got[ids], _blocks(want)[remote_ids])
        assert not got[np.setdiff1d(np.arange(NBLK), ids)].any(), "READ wrote outside the requested blocks"
    else:
        far = _blocks(peer.contents()[0])
        np.testing.assert_array_equal(far[remote_ids], _blocks(want)[ids])
        assert not far[np.setdiff1d(np.arange(NBLK), remote_ids)].any(), "WRITE touched other blocks"


def test_split_write_notifies_after_both_halves(make_backend, peer):
    backend = make_backend(split_bytes=SPLIT)
    local, _, lp, rp = _setup(backend, peer)
    local[:] = pattern(21, NBYTES)
    ids = np.arange(NBLK)
    h = backend.transfer(Op.WRITE, lp, ids, rp, ids, notif=b"all-of-it")
    [(_, msg, snapshot)] = peer.await_notifs(1)
    assert msg == b"all-of-it"
    np.testing.assert_array_equal(snapshot, local, "the notification arrived before both halves had landed")
    _done(backend, h)


def test_peer_killed_during_split_reads(make_backend, peer, spawn_peer):
    """kill -9 while split READs run back to back: every transfer settles (a
    dead peer's DONE is refused by the pid check), later ones fail, nothing
    hangs or aborts, and the helper lane then serves another peer."""
    backend = make_backend(split_bytes=SPLIT)
    local, _, lp, rp = _setup(backend, peer)
    ids = np.arange(NBLK)
    killer = threading.Timer(0.3, peer.kill)
    killer.start()
    states, end = [], time.monotonic() + 5
    try:
        while time.monotonic() < end:
            h = backend.transfer(Op.READ, lp, ids, rp, ids)
            state = settle(backend, h, TIMEOUT + 5)
            backend.release(h)
            assert not state.pending, "a split READ never settled"
            states.append(state)
            if state.failed:
                break
    finally:
        killer.join()
    assert states[-1].failed and isinstance(states[-1].cause, TransferError), states[-1]
    state = settle(backend, backend.transfer(Op.READ, lp, ids, rp, ids), TIMEOUT + 5)
    assert state.failed, state
    other = spawn_peer("other")
    want = other.fill(8)
    oname = backend.add_remote(other.metadata())
    orp = backend.prep(oname, Descs.from_blocks(other.main_addr, BLOCK, np.arange(NBLK)))
    assert backend._peers[oname].ep.lanes() == 2
    _done(backend, backend.transfer(Op.READ, lp, ids, orp, ids))
    np.testing.assert_array_equal(local, want)


@pytest.mark.parametrize("options", [{"split_bytes": 0}, {"split_bytes": SPLIT, "ucx": TCP_ONLY}],
                         ids=["disabled", "tcp"])
def test_no_second_lane_when_disabled_or_without_cma(make_backend, peer, options):
    """Over messages (tcp) a split would only wait twice: one lane."""
    backend = make_backend(**options)
    _, name, lp, rp = _setup(backend, peer)
    assert backend._peers[name].ep.lanes() == 1
    _done(backend, backend.transfer(Op.READ, lp, np.arange(NBLK), rp, np.arange(NBLK)))


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_many_blocks_over_tcp(make_backend, peer, op):
    """UCX's TCP transport emulates RMA with messages the target's progress
    thread serves: 200 scattered blocks posted at once, all land."""
    rng = np.random.default_rng(4)
    _move_and_check(make_backend(ucx=TCP_ONLY), peer, op, rng.permutation(NBLK)[:200],
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


def test_withdrawn_memory_is_refused_once_the_peer_metadata_is_reloaded(backend, peer):
    """A one-sided backend cannot ask the target: withdrawn memory loses its
    remote key, and fresh metadata no longer lists it, so prep refuses it."""
    name = backend.add_remote(peer.metadata())
    backend.prep(name, Descs.from_regions([peer.extra_addr], [EXTRA]))
    peer.withdraw_extra()
    name = backend.add_remote(peer.metadata())
    with pytest.raises(InvalidDescriptor):
        backend.prep(name, Descs.from_regions([peer.extra_addr], [EXTRA]))


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


@pytest.mark.parametrize("tls", [TCP_ONLY, SHM_ONLY], ids=["tcp", "shm"])
def test_peer_death_ends_in_flight_transfers_and_the_agent_serves_others(make_backend, peer, spawn_peer, tls):
    """Over TCP or shared memory (without cross-memory attach) RMA is emulated
    by messages, so a frozen target never completes one.  Killed, it is
    detected well before the timeout: over TCP UCX sees the socket close;
    over shared memory nothing would tell UCX (no peer error handling on one
    host), and the pid watch of the progress thread ends the transfers."""
    backend = make_backend(ucx=tls)
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
    backend = make_backend(timeout=1.0, ucx=TCP_ONLY)  # cross-memory attach would read a frozen peer fine
    _, _, lp, rp = _setup(backend, peer)
    peer.freeze()
    try:
        start = time.monotonic()
        state = settle(backend, backend.transfer(Op.READ, lp, [0], rp, [0]), 10)
        assert state.failed and isinstance(state.cause, TimeoutError), state
        assert time.monotonic() - start < 5
    finally:
        peer.thaw()


def test_remove_remote_ends_in_flight_transfers(make_backend, peer):
    backend = make_backend(ucx=TCP_ONLY)
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
    """A peer starts a WRITE into us and is killed at once: we go on serving."""
    local = np.zeros(NBYTES, np.uint8)
    backend.register(Descs.from_buffers([local]))
    victim = spawn_peer("victim")
    victim.fill(9)
    victim.write_to(backend.local_metadata(), local.ctypes.data)
    victim.kill()
    other = spawn_peer("other")
    want = _blocks(other.fill(8))
    name = backend.add_remote(other.metadata())
    lp = backend.prep(None, Descs.from_blocks(local.ctypes.data, BLOCK, np.arange(NBLK)))
    rp = backend.prep(name, Descs.from_blocks(other.main_addr, BLOCK, np.arange(NBLK)))
    _done(backend, backend.transfer(Op.READ, lp, np.arange(NBLK), rp, np.arange(NBLK)))
    np.testing.assert_array_equal(_blocks(local), want)


def test_peer_killed_mid_read_ends_in_err_and_we_survive(make_backend, spawn_peer):
    """kill -9 of the target while READs of its memory run (cross-memory
    attach, no UCX peer error handling), KILL_RUNS times: every time the
    transfer ends in ERR within the timeout and this process lives on."""
    runs = int(os.environ.get("KVT_UCX_KILL_RUNS", "20"))
    rng = np.random.default_rng(11)
    for run in range(runs):
        backend = make_backend(f"survivor{run}")
        peer = spawn_peer(f"doomed{run}", nbytes=BIG)
        local = np.zeros(BIG, np.uint8)
        backend.register(Descs.from_buffers([local]))
        name = backend.add_remote(peer.metadata())
        lp = backend.prep(None, Descs.from_blocks(local.ctypes.data, 1 << 16, np.arange(BIG >> 16)))
        rp = backend.prep(name, Descs.from_blocks(peer.main_addr, 1 << 16, np.arange(BIG >> 16)))
        killer = threading.Timer(rng.uniform(0.0, 0.05), peer.kill)
        killer.start()
        start, state = time.monotonic(), None
        while time.monotonic() - start < TIMEOUT + 5:
            state = settle(backend, backend.transfer(Op.READ, lp, None, rp, None), TIMEOUT + 5)
            if state.failed:
                break
        killer.join()
        assert state is not None and state.failed, f"run {run}: READs kept succeeding from a killed peer"
        assert isinstance(state.cause, (PeerDisconnected, TransferError)), state
        assert time.monotonic() - start < TIMEOUT, f"run {run}: death not detected within the timeout"
        backend.close()
