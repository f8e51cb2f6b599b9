"""Transfer: telemetry, event-driven wait, and ``await`` (host backend)."""

import asyncio
import os
import signal
import threading

import numpy as np
import pytest

from kvt import Agent, memory
from kvt.agent import Telemetry
from kvt.errors import KvtTimeoutError
from kvt_conformance.peer import freeze

from peer import BLOCK, NUM_BLOCKS, peer_process


@pytest.fixture
def two():
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        abuf, bbuf = memory.empty((8, 4096)), memory.empty((8, 4096))
        bbuf[:] = np.arange(8, dtype=np.uint8)[:, None]
        a.register_blocks("kv", [abuf[:4], abuf[4:]])  # two regions: block ids map to two descriptors each
        b.register_blocks("kv", [bbuf[:4], bbuf[4:]])
        yield a, a.add_peer(b.info()), abuf, bbuf


def test_telemetry_counts_bytes_and_descriptors(two):
    a, peer, abuf, bbuf = two
    with a.read_blocks(peer, [0, 1, 2], [3, 2, 1]) as x:
        x.wait(10)
        t = x.telemetry
    assert isinstance(t, Telemetry)
    assert (t.nbytes, t.descs) == (6 * 4096, 6)
    assert t.post_s >= 0 and t.xfer_s is not None and t.xfer_s >= 0
    assert np.array_equal(abuf[[0, 1, 2, 4, 5, 6], 0], bbuf[[3, 2, 1, 7, 6, 5], 0])


def test_await_a_transfer(two):
    a, peer, abuf, bbuf = two

    async def main():
        await a.read_blocks(peer, [3], [0])
        x = a.write_blocks(peer, [3], [1])
        await x
        return x

    x = asyncio.run(main())
    x.release()
    assert (abuf[3] == 0).all() and (abuf[7] == 4).all()
    assert (bbuf[1] == 0).all()


def test_route_is_rebuilt_when_the_layout_changes(two):
    a, peer, abuf, _ = two
    a.read_blocks(peer, [0], [0]).wait(10)
    other = memory.empty((4, 8192))
    a.register_blocks("kv", [other])  # one region of 8 KiB blocks: no longer matches the peer
    from kvt.errors import IncompatiblePeer
    with pytest.raises(IncompatiblePeer):
        a.read_blocks(peer, [0], [0])


def test_wait_blocks_on_completion_event_and_times_out_on_a_frozen_peer():
    """A frozen peer answers nothing: ``wait(1)`` returns after about a second
    with KvtTimeoutError, blocked in the backend's event wait (not polling)."""
    with peer_process() as p, Agent(name="me", options={"timeout": 30, "transport": "tcp"}) as me:
        me.register_blocks("kv", [np.zeros((NUM_BLOCKS, BLOCK), np.uint8)])
        name = me.connect(p.endpoint, timeout=10)
        calls = []
        real = me.backend.wait
        me.backend.wait = lambda h, t: calls.append(t) or real(h, t)
        freeze(p.proc.pid)
        try:
            x = me.read_blocks(name, [1], [2])
            with pytest.raises(KvtTimeoutError):
                x.wait(1)
            assert calls == [1] and x.telemetry.xfer_s is None
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        x.wait(20)  # thawed: the same transfer completes
        x.release()


def test_host_wait_wakes_when_the_worker_settles_the_job(two):
    a, peer, _, _ = two
    from kvt_host.backend import _Job
    from kvt.types import XferState

    job = _Job(None, None, None, None, None, None, None)
    threading.Timer(0.05, job.finish, [XferState.DONE]).start()
    assert job.wait(30) is XferState.DONE
    assert job.event is not None and job.event.is_set()  # woken by the worker, not by the timeout
    job.finish(XferState.err(None))  # first outcome wins
    assert job.wait(0) is XferState.DONE
