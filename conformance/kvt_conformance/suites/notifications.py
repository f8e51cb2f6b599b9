"""Notifications: standalone and attached to a transfer, an attached one
arriving only after its data, in order per peer, up to the declared size."""

from __future__ import annotations

import threading
import time

import numpy as np
from kvt.agent import poll_until
from kvt.errors import KvtTimeoutError
from kvt.types import Op

from ..fixtures import BackendFixtures, expect_done
from ..requirements import requires
from ._common import (CONTRACT_BLOCK, CONTRACT_BLOCKS, CONTRACT_BYTES, CONTRACT_REPEATS, assert_bytes, contract_setup,
                      contract_source, moved, scattered)
from .descriptors import HUGE, SMALL


def collect(backend, sender: str, count: int, timeout: float, polling=None) -> list[bytes]:
    """Poll ``get_notifs`` until ``count`` messages from ``sender`` arrived
    (fewer if ``timeout`` runs out); messages from others are ignored.
    ``polling``: a transfer of ours to poll meanwhile, as an engine polls
    what it posted (some backends progress transfers only then)."""
    got: list[bytes] = []

    def enough() -> bool:
        if polling is not None:
            backend.check_state(polling)
        got.extend(backend.get_notifs().get(sender, ()))
        return len(got) >= count

    try:
        poll_until(enough, timeout, "notifications")
    except KvtTimeoutError:
        pass
    return got


#: transfers of the exactly-once test, each with its own notification
ONCE = 8
_markers = iter(range(1 << 62))


def _strays(peer, sender: str) -> str:
    """For a failure message: what ``peer`` got from senders other than ``sender``."""
    others = peer.other_senders(sender)
    return (f"; it got {sum(others.values())} from {sorted(others)!r:.200} instead: deliver each notification "
            f"under the sending agent's name, {sender!r}") if others else ""


def _until_marker(backend, peer, name: str, wait_for: float) -> list[bytes]:
    """Send ``peer`` (agent ``name``) a marker and return every message from
    ``backend`` it received before the marker (messages to one peer arrive in
    the order sent: the marker ends what could have arrived before it)."""
    marker = b"marker-%d" % next(_markers)
    backend.notify(name, marker)
    seen: list[bytes] = []
    while marker not in seen:
        got = peer.take_notifs(backend.agent_name, 1, wait_for)
        assert got, (f"the marker notification never arrived at {name!r} (got {seen!r:.200} before it)"
                     f"{_strays(peer, backend.agent_name)}")
        seen += got
    return seen[:seen.index(marker)]


def _arrive_exactly_once(backend, peer, name: str, msgs: list[bytes], wait_for: float, what: str) -> None:
    """Every message of ``msgs`` from ``backend`` arrives at ``peer``, each
    once: wait until all did, then collect up to a marker; none twice, none
    other."""
    seen: list[bytes] = []
    while not set(msgs) <= set(seen):
        got = peer.take_notifs(backend.agent_name, 1, wait_for)
        assert got, (f"{what}: {sorted(set(msgs) - set(seen))!r:.200} never reached {name!r}, the target "
                     f"(it got {seen!r:.200}){_strays(peer, backend.agent_name)}")
        seen += got
    seen += _until_marker(backend, peer, name, wait_for)
    twice = sorted({m for m in seen if seen.count(m) > 1})
    assert not twice, f"{what}: {twice!r:.200} reached {name!r} more than once; deliver each exactly once"
    other = [m for m in seen if m not in msgs]
    assert not other, f"{what}: {name!r} also received {other!r:.200}, which nobody sent it"


@requires("notifications")
class NotificationTests(BackendFixtures):
    area = "notifications"
    block = 4096
    nblocks = 64

    def test_standalone(self, backend, peer, wait_for):
        name = backend.add_remote(peer.metadata())
        backend.notify(name, b"hello")
        assert peer.take_notifs(backend.agent_name, 1, wait_for) == [b"hello"]

    def test_empty_message(self, backend, peer, wait_for):
        name = backend.add_remote(peer.metadata())
        backend.notify(name, b"")
        backend.notify(name, b"after")
        assert peer.take_notifs(backend.agent_name, 2, wait_for) == [b"", b"after"], (
            "an empty notification is a message like any other: deliver it, in order")

    def test_in_order_per_peer(self, backend, peer, wait_for):
        name = backend.add_remote(peer.metadata())
        msgs = [b"msg-%04d" % i for i in range(200)]
        for m in msgs:
            backend.notify(name, m)
        assert peer.take_notifs(backend.agent_name, len(msgs), wait_for) == msgs

    def test_from_peer_in_order(self, backend, peer, wait_for):
        peer.load(backend)
        msgs = [b"back-%03d" % i for i in range(100)]
        peer.notify(backend.agent_name, msgs)
        assert collect(backend, peer.name, len(msgs), wait_for) == msgs

    def test_two_senders_each_in_order(self, backend, make_backend, peer, wait_for):
        other = make_backend()
        md = peer.metadata()
        a, b = backend.add_remote(md), other.add_remote(md)
        for i in range(50):
            backend.notify(a, b"a%d" % i)
            other.notify(b, b"b%d" % i)
        assert peer.take_notifs(backend.agent_name, 50, wait_for) == [b"a%d" % i for i in range(50)]
        assert peer.take_notifs(other.agent_name, 50, wait_for) == [b"b%d" % i for i in range(50)]

    def test_largest_declared_message(self, backend, peer, target, wait_for):
        size = min(target.caps.max_notif_bytes, 1 << 20)
        msg = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        backend.notify(backend.add_remote(peer.metadata()), msg)
        assert peer.take_notifs(backend.agent_name, 1, wait_for) == [msg]

    def test_nothing_pending_is_empty(self, backend):
        assert not any(backend.get_notifs().values())

    @requires("WRITE")
    def test_attached_to_write_arrives_after_its_data(self, backend, local_buffer, peer, wait_for):
        size = self.block * self.nblocks
        src, dst = local_buffer(size, seed=31), peer.alloc(size)
        name = backend.add_remote(peer.metadata())
        ids = np.arange(self.nblocks)
        lp, rp = backend.prep(None, src.blocks(self.block, ids)), backend.prep(name, dst.blocks(self.block, ids))
        # the peer starts watching before the write is posted
        snap: list = []
        watcher = threading.Thread(target=lambda: snap.append(
            peer.snapshot_on_notif(backend.agent_name, b"written", dst.key, wait_for)), daemon=True)
        watcher.start()
        handle = backend.transfer(Op.WRITE, lp, None, rp, None, notif=b"written")
        expect_done(backend, handle, wait_for)
        watcher.join(wait_for + 35)
        assert snap and snap[0] is not None, "the notification attached to the WRITE never arrived"
        assert_bytes(np.frombuffer(snap[0], np.uint8), src.read(), "peer memory when the notification arrived")

    @requires("READ")
    def test_attached_to_read(self, backend, local_buffer, peer, wait_for):
        size = self.block * self.nblocks
        dst, src = local_buffer(size), peer.alloc(size, seed=32)
        name = backend.add_remote(peer.metadata())
        ids = np.arange(self.nblocks)
        lp, rp = backend.prep(None, dst.blocks(self.block, ids)), backend.prep(name, src.blocks(self.block, ids))
        handle = backend.transfer(Op.READ, lp, None, rp, None, notif=b"read-done")
        expect_done(backend, handle, wait_for)
        assert_bytes(dst.read(), src.read())
        assert peer.take_notifs(backend.agent_name, 1, wait_for) == [b"read-done"]

    @requires("local", "READ")
    def test_attached_to_local_transfer(self, backend, local_buffer, wait_for):
        """A local transfer's notification comes to this agent, after the data."""
        size = self.block * self.nblocks
        src, dst = local_buffer(size, seed=33), local_buffer(size)
        ids = np.arange(self.nblocks)
        sp, dp = backend.prep(None, src.blocks(self.block, ids)), backend.prep(None, dst.blocks(self.block, ids))
        handle = backend.transfer(Op.READ, dp, None, sp, None, notif=b"local-done")
        got = collect(backend, backend.agent_name, 1, wait_for, polling=handle)
        snapshot = dst.read()  # first thing after the notification
        assert got == [b"local-done"]
        assert_bytes(snapshot, src.read(), "destination when the notification arrived")

    def test_attached_notif_arrives_exactly_once_at_its_target(self, backend, local_buffer, peer, op, wait_for):
        """Eight transfers with the peer, each with its own notification:
        each arrives at the peer exactly once (once all have, a marker sent
        after them ends what could still come: no copy may arrive before it),
        and none at this agent, the initiator."""
        near = local_buffer(self.block * ONCE, seed=34 if op is Op.WRITE else None)
        far = peer.alloc(self.block * ONCE, seed=35 if op is Op.READ else None)
        name = backend.add_remote(peer.metadata())
        ids = np.arange(ONCE)
        lp, rp = backend.prep(None, near.blocks(self.block, ids)), backend.prep(name, far.blocks(self.block, ids))
        msgs = [b"once-%d" % i for i in range(ONCE)]
        handles = [backend.transfer(op, lp, [i], rp, [i], notif=m) for i, m in enumerate(msgs)]
        for h in handles:
            expect_done(backend, h, wait_for)
        _arrive_exactly_once(backend, peer, name, msgs, wait_for, f"notifications attached to {op.value}s")
        mine = [m for ms in backend.get_notifs().values() for m in ms if m in msgs]
        assert not mine, (f"this agent, the initiator, received {mine!r}: a transfer's notification goes to the "
                          "target (the peer), only there")

    def test_attached_notif_reaches_its_target_among_two_peers(self, backend, local_buffer, peer, new_peer, op,
                                                               wait_for):
        """Two peers loaded, one after the other; a transfer with each, with a
        notification: it arrives exactly once at the transfer's target, and
        not at all at the other peer (a marker sent to each afterwards ends
        what could still come), whichever of the two was loaded last."""
        other = new_peer()
        near = local_buffer(self.block * 2, seed=36 if op is Op.WRITE else None)
        lp = backend.prep(None, near.blocks(self.block, [0, 1]))
        fars = [p.alloc(self.block, seed=37 if op is Op.READ else None) for p in (peer, other)]
        names = [backend.add_remote(p.metadata()) for p in (peer, other)]  # the other peer is loaded last
        rps = [backend.prep(n, f.blocks(self.block, [0])) for n, f in zip(names, fars)]
        pair = ((peer, names[0], rps[0]), (other, names[1], rps[1]))
        for i, (to, to_name, rp) in enumerate(pair):
            (bystander, by_name, _) = pair[1 - i]
            msg = b"for-%s" % to_name.encode()
            expect_done(backend, backend.transfer(op, lp, [i], rp, [0], notif=msg), wait_for)
            which = "first" if i == 0 else "last"
            _arrive_exactly_once(backend, to, to_name, [msg], wait_for,
                                 f"the notification of a {op.value} with the peer loaded {which}")
            stray = _until_marker(backend, bystander, by_name, wait_for)
            assert not stray, (f"peer {by_name!r} received {stray!r} though the {op.value} was with {to_name!r}: "
                               "a transfer's notification goes to its target only")

    # -- the contract, seen deterministically: many scattered blocks, several MiB,
    # -- a receiver spinning on get_notifs, every byte checked at that instant, repeated

    def test_attached_notif_follows_every_byte_at_the_peer(self, backend, local_buffer, peer, op, wait_for):
        """WRITE: the peer spins on ``get_notifs`` and copies its memory the
        instant the notification appears; every byte must be there.  READ:
        the notification tells the owner its memory was read, so the peer
        overwrites it at that instant; the initiator's copy must still be
        the original (an early notification lets the overwrite leak in)."""
        near, far, lp, rp = contract_setup(backend, local_buffer, peer)
        for rep in range(CONTRACT_REPEATS):
            near_ids, far_ids, msg = *scattered(rep), b"notif-%d" % rep
            src = contract_source(op, near, far, peer, 1000 + rep)
            want = moved(src, near_ids, far_ids) if op is Op.WRITE else moved(src, far_ids, near_ids)
            peer.start_spin(backend.agent_name, msg, far.key, wait_for, scribble=op is Op.READ)
            handle = backend.transfer(op, lp, near_ids, rp, far_ids, notif=msg)
            expect_done(backend, handle, wait_for)
            snap = [peer.spin_result(wait_for)]
            backend.release(handle)
            assert snap[0] is not None, (
                f"repetition {rep}: the notification attached to a {op.value} never reached the peer; "
                "deliver a transfer's notif to the peer (the target) once its bytes have moved")
            if op is Op.WRITE:
                assert_bytes(np.frombuffer(snap[0], np.uint8), want,
                             f"repetition {rep}: peer memory the instant the WRITE's notification appeared "
                             "(send the notification only after the last byte landed at the target)")
            else:
                assert_bytes(near.read(), want,
                             f"repetition {rep}: READ data, when the peer overwrote its memory the instant the "
                             "READ's notification appeared (send it only after the last byte was read)")

    def test_attached_notif_follows_every_byte_of_a_long_list(self, backend, local_buffer, peer, op, wait_for):
        """The same at the peer, for 100,000 rows in one transfer: more than
        a backend may put in one request on its wire (kvt's host backend cuts
        at 65,536 rows), so a notification sent with the first request rather
        than after the last is seen."""
        near = local_buffer(HUGE * SMALL)
        far = peer.alloc(2 * HUGE * SMALL, seed=61 if op is Op.READ else None)
        name = backend.add_remote(peer.metadata())
        near_ids, far_ids = np.arange(HUGE)[::-1], np.arange(0, 2 * HUGE, 2)  # no two rows contiguous on both sides
        lp, rp = backend.prep(None, near.blocks(SMALL, near_ids)), backend.prep(name, far.blocks(SMALL, far_ids))
        src = near.fill(62) if op is Op.WRITE else far.read()
        want = np.zeros((2 * HUGE, SMALL), np.uint8) if op is Op.WRITE else np.zeros((HUGE, SMALL), np.uint8)
        if op is Op.WRITE:
            want[far_ids] = src.reshape(-1, SMALL)[near_ids]
        else:
            want[near_ids] = src.reshape(-1, SMALL)[far_ids]
        patience = 3 * wait_for  # 100,000 rows: as the huge-list descriptor tests allow
        peer.start_spin(backend.agent_name, b"long-list", far.key, patience, scribble=op is Op.READ)
        handle = backend.transfer(op, lp, None, rp, None, notif=b"long-list")
        expect_done(backend, handle, patience)
        snap = peer.spin_result(patience)
        assert snap is not None, f"the notification attached to a {op.value} of {HUGE} rows never reached the peer"
        if op is Op.WRITE:
            assert_bytes(np.frombuffer(snap, np.uint8), want.ravel(),
                         f"peer memory the instant the notification of a WRITE of {HUGE} rows appeared (send it "
                         "only after the last request landed, not with the first)")
        else:
            assert_bytes(near.read(), want.ravel(),
                         f"READ of {HUGE} rows, when the peer overwrote its memory the instant the notification "
                         "appeared (send it only after the last request was read, not with the first)")

    @requires("local")
    def test_attached_notif_follows_every_byte_locally(self, backend, local_buffer, op, wait_for):
        """A local transfer's notification comes to this agent (sender: its
        own name), and only once every byte is at the destination."""
        a, b = local_buffer(CONTRACT_BYTES), local_buffer(CONTRACT_BYTES)
        every = np.arange(2 * CONTRACT_BLOCKS)
        ap, bp = (backend.prep(None, x.blocks(CONTRACT_BLOCK, every)) for x in (a, b))
        me = backend.agent_name
        for rep in range(CONTRACT_REPEATS):
            a_ids, b_ids, msg = *scattered(rep), b"local-%d" % rep
            src, dst = (b, a) if op is Op.READ else (a, b)
            data = src.fill(2000 + rep)
            dst.write(np.zeros(CONTRACT_BYTES, np.uint8))
            want = moved(data, b_ids, a_ids) if op is Op.READ else moved(data, a_ids, b_ids)
            handle = backend.transfer(op, ap, a_ids, bp, b_ids, notif=msg)
            deadline, got, snapshot = time.monotonic() + wait_for, [], None
            while snapshot is None and time.monotonic() < deadline:  # spin: no sleep
                backend.check_state(handle)  # as an engine polls what it posted
                notifs = backend.get_notifs()
                if msg in notifs.get(me, ()):
                    snapshot = dst.read()
                got.extend(m for ms in notifs.values() for m in ms)
            assert snapshot is not None, (
                f"repetition {rep}: no notification {msg!r} from {me!r} (this agent) within {wait_for:g}s; "
                f"got {got[:5]!r}. A local transfer's notif goes to the agent itself, with its own name as sender")
            assert_bytes(snapshot, want, f"repetition {rep}: local {op.value} destination the instant "
                         "its notification appeared (deliver it only after the last byte landed)")
            expect_done(backend, handle, wait_for)
            backend.release(handle)
