"""Every verb between two processes, and between two lists of one agent."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvt.handshake import HandshakeServer
from kvt.types import Descs, Op, Status
from peerproc import BLOCK, NUM_BLOCKS, load, pattern, settle


@pytest.fixture
def pair(make_backend, peer, local_buf):
    """(backend, peer, peer name, local prep, remote prep): our buffer and the
    peer's, both as NUM_BLOCKS blocks, metadata fetched through the handshake."""
    b = make_backend()
    b.register(Descs.from_buffers([local_buf]))
    name = load(b, peer)
    ids = np.arange(NUM_BLOCKS)
    lp = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, ids))
    return b, peer, name, lp, b.prep(name, peer.blocks(ids))


@pytest.mark.parametrize("index", [np.int32, np.int64, list], ids=["int32", "int64", "list"])
def test_read_pulls_the_peers_blocks(pair, local_buf, index):
    b, peer, name, lp, rp = pair
    local, remote = np.array([0, 5, 6, 63]), np.array([63, 2, 3, 0])
    as_idx = (lambda a: a.tolist()) if index is list else (lambda a: a.astype(index))
    h = b.transfer(Op.READ, lp, as_idx(local), rp, as_idx(remote))
    assert settle(b, h).status is Status.DONE
    b.release(h)
    np.testing.assert_array_equal(local_buf[local], pattern()[remote])
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), local)
    assert not local_buf[untouched].any(), "READ wrote outside the blocks it was given"


def test_write_pushes_our_blocks(pair, local_buf):
    b, peer, name, lp, rp = pair
    local_buf[:] = pattern(salt=2)
    local, remote = np.arange(8), np.arange(50, 58)
    h = b.transfer(Op.WRITE, lp, local, rp, remote)
    assert settle(b, h).done
    b.release(h)
    want = pattern()
    want[remote] = pattern(salt=2)[local]
    np.testing.assert_array_equal(peer.contents(), want)


def test_whole_lists_with_none(pair, local_buf):
    b, peer, name, lp, rp = pair
    h = b.transfer(Op.READ, lp, None, rp, None)
    assert settle(b, h).done
    np.testing.assert_array_equal(local_buf, pattern())


def test_write_notification_arrives_after_its_data(pair, local_buf):
    """The peer copies its memory the moment it sees the notification: every
    written byte must already be there."""
    b, peer, name, lp, rp = pair
    local_buf[:] = pattern(salt=3)
    snaps: list = []
    watcher = threading.Thread(target=lambda: snaps.append(peer.call("await_notif", b.agent_name, b"kv-ready-7")))
    watcher.start()  # the peer watches while we post and poll (NIXL sends the notification from our polls)
    h = b.transfer(Op.WRITE, lp, None, rp, None, notif=b"kv-ready-7")
    assert settle(b, h).done
    watcher.join(40)
    assert snaps and snaps[0] is not None, "the notification never arrived"
    np.testing.assert_array_equal(np.frombuffer(snaps[0], np.uint8).reshape(NUM_BLOCKS, BLOCK), pattern(salt=3))


def test_read_notification_reaches_the_peer(pair, local_buf):
    b, peer, name, lp, rp = pair
    h = b.transfer(Op.READ, lp, [1, 2], rp, [3, 4], notif=b"read-done")
    assert settle(b, h).done
    assert peer.call("take", b.agent_name, 1) == [b"read-done"]
    np.testing.assert_array_equal(local_buf[[1, 2]], pattern()[[3, 4]])


def test_notifications_both_ways_in_order(pair):
    b, peer, name, lp, rp = pair
    msgs = [b"m%03d" % i for i in range(20)] + [b"x" * b.capabilities.max_notif_bytes]
    for m in msgs:
        b.notify(name, m)
    assert peer.call("take", b.agent_name, len(msgs)) == msgs
    # the peer reaches us once it has our metadata, fetched through our handshake server
    with HandshakeServer(lambda _req: b.local_metadata()) as server:
        assert peer.call("load", server.endpoint) == b.agent_name
    peer.call("notify", b.agent_name, b"hello back")
    got, deadline = {}, time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = b.get_notifs()
    assert got == {name: [b"hello back"]}
    assert b.get_notifs() == {}, "a notification was delivered twice"


def test_local_transfers_and_their_notification(make_backend):
    b = make_backend()
    src, dst = pattern(salt=4), np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
    b.register(Descs.from_buffers([src, dst]))
    sp = b.prep(None, Descs.from_blocks(src.ctypes.data, BLOCK, range(NUM_BLOCKS)))
    dp = b.prep(None, Descs.from_blocks(dst.ctypes.data, BLOCK, range(NUM_BLOCKS)))
    h1 = b.transfer(Op.READ, dp, [0, 1], sp, [9, 8])           # dst <- src
    h2 = b.transfer(Op.WRITE, sp, [5], dp, [7], notif=bytearray(b"local"))  # src -> dst; any bytes-like
    assert settle(b, h1).done and settle(b, h2).done
    np.testing.assert_array_equal(dst[[0, 1, 7]], src[[9, 8, 5]])
    got, deadline = {}, time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = b.get_notifs()
    assert got == {b.agent_name: [b"local"]}


def _counting_notifs(b, monkeypatch) -> list:
    asked, real = [], b._agent.get_new_notifs
    monkeypatch.setattr(b._agent, "get_new_notifs", lambda *a: (asked.append(1), real(*a))[1])
    return asked


def test_asked_every_step_nixl_is_asked_once_per_quiet_window(make_backend, monkeypatch):
    """NIXL's getNotifs lets go of the GIL; an engine asking every step would
    starve the process's other threads (benchmarks/bench_step_poll.py).
    After a call that found nothing, calls within ``notif_quiet_us`` answer
    without NIXL; what arrived meanwhile comes with the first call after it,
    and after a call that found something the next one asks NIXL at once."""
    b = make_backend(notif_quiet_us=1_000_000)
    asked = _counting_notifs(b, monkeypatch)
    buf = np.zeros((2, BLOCK), np.uint8)
    b.register(Descs.from_buffers([buf]))
    p = b.prep(None, Descs.from_blocks(buf.ctypes.data, BLOCK, range(2)))
    assert b.get_notifs() == {} and len(asked) == 1
    assert settle(b, b.transfer(Op.WRITE, p, [0], p, [1], notif=b"landed")).done
    for _ in range(100):
        assert b.get_notifs() == {}
    assert time.monotonic() < b._notifs_after and len(asked) == 1  # (still within the window)
    got, deadline = {}, time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = b.get_notifs()
    assert got == {b.agent_name: [b"landed"]} and len(asked) == 2
    assert b.get_notifs() == {} and len(asked) == 3, "asked at once after a call that found something"


@pytest.mark.parametrize("options", [{"notif_quiet_us": 0}, {"progress_thread": False}],
                         ids=["quiet-0", "no-progress-thread"])
def test_nixl_is_asked_every_time_without_a_quiet_window(make_backend, monkeypatch, options):
    """``notif_quiet_us=0``, and without the progress thread, where getNotifs
    is what progresses a target: every call asks NIXL."""
    b = make_backend(**options)
    asked = _counting_notifs(b, monkeypatch)
    for _ in range(20):
        assert b.get_notifs() == {}
    assert len(asked) == 20


def test_zero_rows_is_done_and_still_notifies(pair):
    b, peer, name, lp, rp = pair
    h = b.transfer(Op.WRITE, lp, np.array([], np.int64), rp, [], notif=b"nothing-to-move")
    assert b.check_state(h).done
    assert peer.call("take", b.agent_name, 1) == [b"nothing-to-move"]


def test_reloaded_peer_metadata_keeps_old_preps_working(pair, local_buf):
    """NIXL invalidates lists prepped before a reload; kvt re-preps them."""
    b, peer, name, lp, rp = pair
    assert load(b, peer) == name
    h = b.transfer(Op.READ, lp, [3], rp, [4])
    assert settle(b, h).done
    np.testing.assert_array_equal(local_buf[3], pattern()[4])


def test_many_blocks_in_one_transfer(make_backend, peer):
    """Many small blocks in one READ, in a random order: 1024 x 256 B."""
    b = make_backend()
    name = load(b, peer)
    dst = np.zeros(NUM_BLOCKS * BLOCK, np.uint8)
    b.register(Descs.from_buffers([dst]))
    n, size = 1024, 256
    lp = b.prep(None, Descs.from_blocks(dst.ctypes.data, size, np.arange(n)))
    rp = b.prep(name, Descs.from_blocks(peer.addr, size, np.arange(n)))
    perm = np.random.default_rng(0).permutation(n)
    assert settle(b, b.transfer(Op.READ, lp, np.arange(n, dtype=np.int32), rp, perm.astype(np.int32))).done
    np.testing.assert_array_equal(dst.reshape(n, size), pattern().reshape(n, size)[perm])


def test_remove_remote_forgets_the_peer(pair):
    b, peer, name, lp, rp = pair
    b.remove_remote(name)
    from kvt.errors import UnknownPeer
    with pytest.raises(UnknownPeer):
        b.transfer(Op.READ, lp, [0], rp, [0])
    with pytest.raises(UnknownPeer):
        b.notify(name, b"x")
    assert load(b, peer) == name  # and it can be loaded again; the old prep works again
    assert settle(b, b.transfer(Op.READ, lp, [0], rp, [0])).done


def test_remove_and_load_again_opens_no_new_connection(pair):
    """NIXL keeps a removed agent's UCX connection open at both ends until
    close: one remove_remote_agent per remove_peer left a socket behind in
    each process per cycle (the connector removes and re-handshakes a peer
    after every lost connection). A removed peer now stays loaded in NIXL,
    and loading the same metadata again reuses its connection."""
    import os

    b, peer, name, lp, rp = pair
    assert settle(b, b.transfer(Op.READ, lp, [0], rp, [0])).done

    def fds():
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    for _ in range(6):
        b.remove_remote(name)
        assert load(b, peer) == name
        assert settle(b, b.transfer(Op.READ, lp, [1], b.prep(name, peer.blocks(np.arange(NUM_BLOCKS))), [1])).done
    deadline = time.monotonic() + 5  # libzmq closes a handshake socket's fds on its own threads, a moment later
    while fds() > before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fds() <= before + 1, f"{fds() - before} descriptors more after 6 remove/load cycles"


def test_a_removed_peer_that_restarted_is_loaded_anew(make_backend, local_buf):
    """A removed peer stays loaded in NIXL; when it comes back as a new
    process (same name, new metadata) the old one is unloaded first."""
    from peerproc import Peer

    b = make_backend()
    b.register(Descs.from_buffers([local_buf]))
    lp = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, np.arange(NUM_BLOCKS)))
    first = Peer(f"restarting-{time.monotonic_ns()}", {"timeout": 5.0})
    try:
        name = load(b, first)
        b.remove_remote(name)
        first.close()
        second = Peer(name, {"timeout": 5.0})
        try:
            assert load(b, second) == name
            rp = b.prep(name, second.blocks(np.arange(NUM_BLOCKS)))
            assert settle(b, b.transfer(Op.READ, lp, [3], rp, [3])).done
            np.testing.assert_array_equal(local_buf[3], pattern()[3])
        finally:
            second.close()
    finally:
        first.close()


def test_a_parked_peer_whose_reload_fails_stays_parked(pair, monkeypatch):
    """NIXL still has it loaded then: close() must still unload it."""
    from kvt.errors import KvtError

    b, peer, name, lp, rp = pair
    b.remove_remote(name)

    def refuse(blob):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(b._agent, "add_remote_agent", refuse)
    with pytest.raises(KvtError):
        load(b, peer)
    monkeypatch.undo()
    assert name in b._parked and name not in b._peers
    assert load(b, peer) == name and name not in b._parked
