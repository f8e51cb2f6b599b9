"""kvt.epoch: the owner's deregistration counter as a same-host peer sees it."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvt import memcopy, memory
from kvt.epoch import Epoch, EpochWatch
from kvt.types import Descs


def test_a_watch_turns_stale_when_the_owner_bumps():
    owner = Epoch()
    try:
        watch = EpochWatch.open(os.getpid(), owner.fd, owner.value)
        assert watch is not None and not watch.stale
        owner.bump()
        assert watch.stale
        assert not EpochWatch.open(os.getpid(), owner.fd, owner.value).stale  # fresh metadata: fresh watch
        watch.close()
    finally:
        owner.close()


def test_only_an_epoch_page_can_be_watched():
    seg = memory.empty((4096,))  # a kvt segment is a memfd too, but not an epoch
    fd = int(memory.segments_of(Descs.from_buffers([seg]))[0, 2])
    assert EpochWatch.open(os.getpid(), fd, 0) is None
    assert EpochWatch.open(os.getpid(), -1, 0) is None          # metadata without an epoch
    assert EpochWatch.open(os.getpid(), 10**6, 0) is None       # no such fd


# -- guard slots and the liveness word (native engine) ---------------------------

native = pytest.mark.skipif(memcopy.atomic_add is None, reason="guard slots and the liveness word need the "
                                                                 "native engine (kvt._copy)")


def _watch(owner: Epoch, claim_slot: bool = True) -> EpochWatch:
    w = EpochWatch.open(os.getpid(), owner.fd, owner.value, claim_slot)
    assert w is not None
    return w


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@native
def test_each_watch_claims_a_slot_of_its_own_and_gives_it_back():
    owner = Epoch()
    watches = []
    try:
        watches = [_watch(owner) for _ in range(63)]
        assert 0 not in {w.slot for w in watches} and len({w.slot for w in watches}) == 63
        extra = _watch(owner)  # every slot taken: it takes the lock instead
        watches.append(extra)
        assert extra.slot == 0 and extra.hold()
        extra.release()
        freed = watches.pop(0)
        addr = freed.slot
        freed.close()
        watches.append(_watch(owner))
        assert watches[-1].slot == addr
        watches.append(_watch(owner, claim_slot=False))  # a watcher that never copies (nixl, ucx)
        assert watches[-1].slot == 0
    finally:
        for w in watches:
            w.close()
        owner.close()


@native
def test_drain_waits_for_a_copy_counted_in_a_slot_but_not_for_a_dead_claimant():
    owner = Epoch()
    w = _watch(owner)
    try:
        assert w.hold()  # a copy under way, begun before the bump
        owner.bump()
        assert w.stale
        assert not owner.drain(0.05)
        w.release()
        assert owner.drain(1)
        # a claimant that died inside a copy leaves its count up: not waited for...
        i = (w.slot - w.address - 64 - 8) // 64  # (its slot in its own mapping of the page)
        dead = _dead_pid() << 32 | 1
        owner._slots[i] = dead, 1
        owner.bump()
        t0 = time.monotonic()
        assert owner.drain(5) and time.monotonic() - t0 < 1
        # ... and once every slot is taken, its slot is claimed again, counting from zero
        owner._slots[:] = dead, 1
        again = _watch(owner)
        try:
            assert again.slot and memcopy.atomic_add(again.slot, 0) == 0
            assert owner._slots[:, 0].tolist().count(dead) == 62
        finally:
            again.close()
    finally:
        w.close()
        owner.close()


_OWNER = """
import os, sys, time
from kvt.epoch import Epoch
e = Epoch()
pid = os.fork()
if pid == 0:
    os._exit(0)  # a forked child's exit must not mark its parent dead
os.waitpid(pid, 0)
print(os.getpid(), e.fd, flush=True)
time.sleep(60)
"""


@native
def test_the_liveness_word_holds_while_the_owner_lives_and_clears_when_it_dies():
    def word(w: EpochWatch) -> int:
        return int(np.frombuffer(w._mm, np.uint32, 1, 20)[0])

    with subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True) as proc:
        try:
            pid, fd = map(int, proc.stdout.readline().split())
            w = EpochWatch.open(pid, fd, 0, claim_slot=True)
            assert w.alive and w.tid not in (0, pid) and word(w) == w.tid
        finally:
            proc.kill()
        proc.wait(10)
    try:  # killed: the kernel cleared the keeper's id and set FUTEX_OWNER_DIED
        assert word(w) == 0x40000000
    finally:
        w.close()
    owner = Epoch()  # closed: the word is cleared before the page goes
    w = _watch(owner)
    try:
        assert word(w) == w.tid != 0
        owner.close()
        assert word(w) == 0
    finally:
        w.close()
    # dropped without close, in any order of its parts: the keeper writes only into its own mapping
    drop = "from kvt.epoch import Epoch\nfor _ in range(50):\n    Epoch()\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", drop], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr
    # closed while a forked child (holding copies of every fd) lives on: close returns, and the
    # child's own close does not clear its parent's word
    out = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr


_FORKED = """
import os, signal, struct, time
from kvt.epoch import Epoch
e = Epoch()
child = os.fork()
if child == 0:
    e.close()  # the child's copy: must leave the parent's keeper and word alone
    os._exit(0)
os.waitpid(child, 0)
assert struct.unpack_from("=I", e._mm, 20)[0] != 0, "a forked child's close cleared the parent's word"
child = os.fork()
if child == 0:
    time.sleep(60)  # holding copies of every fd of its parent's
    os._exit(0)
e.close()  # hung for ever when the keeper waited for the end of a pipe the child still held
os.kill(child, signal.SIGKILL)
os.waitpid(child, 0)
print("ok")
"""


def test_vouched_watch_takes_only_what_the_owner_published():
    """Backends whose same-host transport acts on whatever memory metadata
    names (UCX's cma) open a peer's page only for what it vouches for."""
    from kvt.epoch import table, vouched_watch
    from kvt.errors import PeerDisconnected, WireError
    from kvt.procs import start_time

    pid, start = os.getpid(), start_time(os.getpid())
    e = Epoch()
    try:
        e.publish(table(b"rows", b"address"))
        w = vouched_watch(pid, start, e.fd, e.value, table(b"rows", b"address"), "owner")
        assert not w.stale
        w.close()
        for parts in [(b"rows+", b"address"), (b"rows", b"another"), (b"rowsaddress",), (b"rows", b"addr", b"ess")]:
            with pytest.raises(WireError, match="vouches for"):
                vouched_watch(pid, start, e.fd, e.value, table(*parts), "owner")
        with pytest.raises(WireError, match="no registration epoch"):
            vouched_watch(pid, start, -1, 0, table(b"rows", b"address"), "owner")
        for bad_pid, bad_start in [(pid, start + 1), (0, start), (1 << 40, start), (pid, -1)]:
            with pytest.raises(PeerDisconnected, match="not running"):
                vouched_watch(bad_pid, bad_start, e.fd, e.value, table(b"rows", b"address"), "owner")
    finally:
        e.close()
