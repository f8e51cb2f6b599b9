"""Concurrency: many transfers in flight at once, posted and polled from
several threads, notifications from several threads, registration churn
while transfers run; backends created, used and closed one after another
leave no thread or file descriptor behind."""

from __future__ import annotations

import gc
import os
import threading
from typing import Callable

import numpy as np
import pytest
from kvt.agent import poll_until
from kvt.errors import KvtTimeoutError
from kvt.types import Op

from ..buffers import Buffer, pattern
from ..fixtures import BackendFixtures, expect_done
from ..requirements import requires
from ._common import assert_bytes, destination, expected, seeds

THREADS = 4
#: backends created, used and closed by the leak test (after one to warm up), and the threads and
#: file descriptors it tolerates beyond its starting counts (things another thread of the process started)
LEAK_CYCLES, LEAK_SLACK = 6, 2


def _resources() -> tuple[int, int]:
    """(threads, open file descriptors) of this process."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def run_threads(fn: Callable[[int], None], n: int, timeout: float) -> None:
    """Run ``fn(i)`` on ``n`` threads; re-raise the first failure, fail on a hang."""
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a thread was still running after {timeout:g}s"
    if errors:
        raise errors[0]


class ConcurrencyTests(BackendFixtures):
    area = "concurrency"
    block = 1024
    nblocks = 128

    def _pair(self, backend, local_buffer, far_buffer, op):
        size = self.block * self.nblocks
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, seed=ns), far_buffer(size, seed=fs)
        ids = np.arange(self.nblocks)
        return near, far, backend.prep(None, near.blocks(self.block, ids)), backend.prep(peer, far.blocks(self.block, ids))

    def test_many_in_flight(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """128 one-block transfers posted before any is polled."""
        near, far, lp, rp = self._pair(backend, local_buffer, far_buffer, op)
        perm = np.random.default_rng(2).permutation(self.nblocks)
        handles = [backend.transfer(op, lp, [i], rp, [perm[i]]) for i in range(self.nblocks)]
        for h in handles:
            expect_done(backend, h, wait_for)
        assert_bytes(destination(op, near, far).read(),
                     expected(op, self.block * self.nblocks, self.block, np.arange(self.nblocks), perm))

    def test_from_several_threads(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """Four threads share the prepped lists; each posts batches over its
        own blocks and polls them, all at once."""
        near, far, lp, rp = self._pair(backend, local_buffer, far_buffer, op)
        perm = np.random.default_rng(3).permutation(self.nblocks)
        mine = np.array_split(np.arange(self.nblocks), THREADS)

        def worker(i: int) -> None:
            batches = np.array_split(mine[i], 8)
            handles = [backend.transfer(op, lp, b, rp, perm[b]) for b in batches]
            for h in handles:
                expect_done(backend, h, wait_for)
                backend.release(h)

        run_threads(worker, THREADS, 2 * wait_for)
        assert_bytes(destination(op, near, far).read(),
                     expected(op, self.block * self.nblocks, self.block, np.arange(self.nblocks), perm))

    @requires("remote")
    def test_two_peers_at_once(self, backend, local_buffer, peer, spawn_peer, op, wait_for):
        """Two peer processes, one thread each, half of our blocks each, in flight together."""
        size = self.block * self.nblocks
        ns, fs = seeds(op)
        near = local_buffer(size, seed=ns)
        fars = []
        for i, p in enumerate((peer, spawn_peer())):
            buf = p.alloc(size, seed=fs and fs + i)
            fars.append((buf, backend.prep(backend.add_remote(p.metadata()), buf.blocks(self.block, range(self.nblocks)))))
        lp = backend.prep(None, near.blocks(self.block, range(self.nblocks)))
        halves = np.array_split(np.arange(self.nblocks), 2)

        def worker(i: int) -> None:
            handles = [backend.transfer(op, lp, b, fars[i][1], b) for b in np.array_split(halves[i], 8)]
            for h in handles:
                expect_done(backend, h, wait_for)

        run_threads(worker, 2, 2 * wait_for)
        if op is Op.READ:
            want = np.concatenate([pattern(fs + i, size).reshape(-1, self.block)[halves[i]] for i in range(2)])
            assert_bytes(near.read(), want)
        else:
            for i, (buf, _) in enumerate(fars):
                want = np.zeros((self.nblocks, self.block), np.uint8)
                want[halves[i]] = pattern(ns, size).reshape(-1, self.block)[halves[i]]
                assert_bytes(buf.read(), want, f"peer {i}")

    @requires("notifications")
    def test_notify_from_several_threads(self, backend, peer, wait_for):
        """Messages of each thread keep their order at the peer."""
        name = backend.add_remote(peer.metadata())
        per = 50

        def worker(i: int) -> None:
            for j in range(per):
                backend.notify(name, b"t%d-%03d" % (i, j))

        run_threads(worker, THREADS, wait_for)
        got = peer.take_notifs(backend.agent_name, THREADS * per, wait_for)
        assert len(got) == THREADS * per, f"{len(got)} of {THREADS * per} notifications arrived"
        for i in range(THREADS):
            mine = [m for m in got if m.startswith(b"t%d-" % i)]
            assert mine == [b"t%d-%03d" % (i, j) for j in range(per)], f"thread {i}'s messages out of order"

    @requires("local", "READ")
    def test_registration_churn_during_transfers(self, backend, local_buffer, make_backend, wait_for):
        """One thread registers, preps and deregisters other memory while
        another moves data; neither disturbs the other."""
        src, dst = local_buffer(self.block * 32, seed=4), local_buffer(self.block * 32)
        sp, dp = backend.prep(None, src.blocks(self.block, range(32))), backend.prep(None, dst.blocks(self.block, range(32)))
        spare = [make_backend.keep(Buffer(4096)) for _ in range(8)]

        def churn(_: int) -> None:
            for k in range(50):
                buf = spare[k % len(spare)]
                h = backend.register(buf.region())
                backend.release(backend.prep(None, buf.blocks(1024, range(4))))
                backend.deregister(h)

        def move(_: int) -> None:
            for i in range(32):
                expect_done(backend, backend.transfer(Op.READ, dp, [i], sp, [31 - i]), wait_for)

        run_threads(lambda i: (churn if i == 0 else move)(i), 2, 2 * wait_for)
        assert_bytes(dst.read(), src.read().reshape(32, self.block)[::-1])

    def test_closed_backends_leave_no_thread_or_fd_behind(self, target, peer, wait_for):
        """``close`` releases everything: backends created, used (a
        registration, a transfer with the peer and, where declared, a local
        one and a notification) and closed one after another, six of them,
        leave this process with as many threads and open file descriptors as
        before (two of each spare, for things another thread starts
        meanwhile).  A first backend warms up what a backend library starts
        once per process."""
        if not os.path.isdir("/proc/self/task"):
            pytest.skip("counts threads and file descriptors in /proc/self (Linux)")
        caps = target.caps
        op = min(caps.ops, key=lambda o: o.value)
        far = peer.alloc(self.block * 4, seed=6)

        def cycle() -> None:
            b = target.create()
            try:
                near = Buffer(self.block * 4)
                b.register(near.region())
                lp = b.prep(None, near.blocks(self.block, range(4)))
                name = b.add_remote(peer.metadata())
                expect_done(b, b.transfer(op, lp, [0, 1], b.prep(name, far.blocks(self.block, range(4))), [0, 1]),
                            wait_for)
                if caps.local:
                    expect_done(b, b.transfer(op, lp, [2], lp, [3]), wait_for)
                if caps.notifications:
                    b.notify(name, b"bye")
            finally:
                b.close()

        cycle()
        gc.collect()
        start = _resources()
        for _ in range(LEAK_CYCLES):
            cycle()
        now = start

        def back() -> bool:
            nonlocal now
            gc.collect()
            now = _resources()
            return now[0] <= start[0] + LEAK_SLACK and now[1] <= start[1] + LEAK_SLACK

        try:
            poll_until(back, wait_for, "threads and file descriptors to be released")
        except KvtTimeoutError:
            pytest.fail(f"after {LEAK_CYCLES} backends were created, used and closed, this process has "
                        f"{now[0]} threads and {now[1]} open file descriptors, {now[0] - start[0]:+d} and "
                        f"{now[1] - start[1]:+d} since before them ({wait_for:g}s later): close must stop every "
                        "thread and close every descriptor the backend opened")
