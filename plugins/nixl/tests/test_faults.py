"""A peer that dies or stops answering: transfers end in ERR within the
``timeout`` option (never hang), and the agent keeps serving other peers."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvt.errors import PeerDisconnected, TransferError, TransferTimeout
from kvt.types import Descs, Op
from peerproc import BLOCK, NUM_BLOCKS, load, pattern, settle

TIMEOUT = 3.0
SLACK = 10.0  # a loaded 2-core machine; the bound is what matters, not speed


@pytest.fixture
def setup(make_backend, spawn_peer, local_buf):
    b = make_backend(timeout=TIMEOUT)
    b.register(Descs.from_buffers([local_buf]))
    victim = spawn_peer("victim", timeout=TIMEOUT)
    name = load(b, victim)
    lp = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, range(NUM_BLOCKS)))
    return b, victim, name, lp, b.prep(name, victim.blocks(range(NUM_BLOCKS)))


def _still_serves(b, peer, local_buf):
    name = load(b, peer)
    lp = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, range(NUM_BLOCKS)))
    rp = b.prep(name, peer.blocks(range(NUM_BLOCKS)))
    local_buf[:] = 0
    assert settle(b, b.transfer(Op.READ, lp, None, rp, None, notif=b"after")).done
    np.testing.assert_array_equal(local_buf, pattern())
    assert peer.call("take", b.agent_name, 1) == [b"after"]


def test_peer_killed_mid_transfer(setup, peer, local_buf):
    """Frozen first so the notifying WRITE is surely in flight (its
    notification waits on the peer), then killed.  Same-host bytes move by
    cross-memory attach even into a frozen process, so a transfer may still
    end DONE (its bytes landed before the kill); none may hang, and an ERR
    carries a TransferError cause."""
    b, victim, name, lp, rp = setup
    victim.freeze()
    posted = [b.transfer(Op.WRITE, lp, None, rp, None, notif=b"never-seen")]
    posted += [b.transfer(op, lp, [i], rp, [i]) for i, op in enumerate([Op.READ, Op.WRITE])]
    time.sleep(0.2)
    victim.kill()
    start = time.monotonic()
    for h in posted:
        s = settle(b, h, TIMEOUT + SLACK)
        assert s.done or isinstance(s.cause, (PeerDisconnected, TransferTimeout)), repr(s)
    assert time.monotonic() - start < TIMEOUT + SLACK
    # the peer is certainly gone now: a new transfer fails with the typed cause
    state = settle(b, b.transfer(Op.READ, lp, [0], rp, [0]), TIMEOUT + SLACK)
    assert state.failed and isinstance(state.cause, PeerDisconnected), repr(state)
    _still_serves(b, peer, local_buf)
    b.remove_remote(name)


def test_frozen_peer_turns_to_transfer_timeout(setup):
    b, victim, name, lp, rp = setup
    victim.freeze()
    start = time.monotonic()
    h = b.transfer(Op.WRITE, lp, [0], rp, [0], notif=b"stuck")
    assert time.monotonic() - start < TIMEOUT, "transfer() waited for the frozen peer"
    state = settle(b, h, TIMEOUT + SLACK)
    elapsed = time.monotonic() - start
    assert state.failed and isinstance(state.cause, TransferTimeout), repr(state)
    assert TIMEOUT <= elapsed < TIMEOUT + SLACK, elapsed
    start = time.monotonic()
    b.release(h)  # NIXL cannot cancel it: bounded by the timeout, never a hang
    assert time.monotonic() - start < TIMEOUT + SLACK


def test_remove_remote_ends_in_flight_transfers(setup):
    b, victim, name, lp, rp = setup
    victim.freeze()
    h = b.transfer(Op.WRITE, lp, [0], rp, [0], notif=b"stuck")
    b.remove_remote(name)
    state = b.check_state(h)
    assert state.failed and isinstance(state.cause, PeerDisconnected), repr(state)
    b.release(h)


def test_transfer_to_exited_peer(setup, peer, local_buf):
    b, victim, name, lp, rp = setup
    victim.close()
    for op in Op:
        state = settle(b, b.transfer(op, lp, None, rp, None), TIMEOUT + SLACK)
        assert state.failed and isinstance(state.cause, TransferError), f"{op.value}: {state!r}"
    assert not local_buf.any(), "bytes arrived from a peer that had exited"
    _still_serves(b, peer, local_buf)
