"""Cases of tests/test_agent_audit.py run in a process of their own, one
backend each: the nixl and ucx wheels bundle their own libucx, so neither
may be loaded into the pytest process.  ``python agent_audit_cases.py
BACKEND CASE`` prints ``ok`` when the case holds."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from kvt import Agent  # noqa: E402


def pair(backend: str, tcp: bool = False):
    """Two agents in this process, ``a`` knowing ``b``; two regions per layout.
    ``tcp``: the host backend talks over TCP (its same-host path is not what a test is about)."""
    opts = {"timeout": 10, **({"transport": "tcp"} if tcp and backend == "host" else {})}
    a, b = Agent(name="a", backend=backend, options=opts), Agent(name="b", backend=backend, options=opts)
    abuf, bbuf = np.zeros((2, 16, 4096), np.uint8), np.ones((2, 16, 4096), np.uint8)
    a.register_blocks("kv", [abuf[0], abuf[1]])
    b.register_blocks("kv", [bbuf[0], bbuf[1]])
    return a, b, a.add_peer(b.info()), abuf


def dropped_transfers_are_released(backend: str) -> None:
    """``agent.read_blocks(...).wait()`` and ``await agent.read_blocks(...)``
    drop the Transfer unreleased: its backend handle must not stay behind."""
    a, b, peer, _ = pair(backend)
    with a, b:
        for _ in range(50):
            a.read_blocks(peer, [0], [1]).wait(10)

        async def main():
            for _ in range(50):
                await a.read_blocks(peer, [1], [2])

        asyncio.run(main())
        gc.collect()
        with a.read_blocks(peer, [2], [3]) as x:  # a later post frees what was dropped
            x.wait(10)
            held = len(a.backend._xfers)
        assert held <= 2, f"{held} transfer handles held after 100 dropped transfers"


def _race(post, mutate, tolerated: tuple) -> None:
    """Two threads run ``post()`` in a loop while this one runs ``mutate()``:
    any exception but ``tolerated`` is the failure."""
    wrong: list[str] = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                post()
            except tolerated:
                pass
            except Exception as e:  # noqa: BLE001 - any escape is the failure
                wrong.append(f"{type(e).__name__}: {e}")
                return

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        mutate()
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not wrong, wrong[:3]


def posting_survives_concurrent_refresh(backend: str) -> None:
    """Threads post transfers while another re-adds the peer (what
    ``reconnect`` does by itself after a failure) or replaces the layout:
    every post succeeds; none fails on a prep the refresh released."""
    a, b, peer, abuf = pair(backend, tcp=True)
    info = b.info()

    def post():
        with a.read_blocks(peer, [1, 2], [3, 4]) as x:
            x.wait(10)

    def refresh():
        for i in range(300):
            if i % 2:
                a.add_peer(info)
            else:
                a.register_blocks("kv", [abuf[0], abuf[1]])
            time.sleep(0.001)

    with a, b:
        _race(post, refresh, ())


def removed_peer_is_unknown(backend: str) -> None:
    """A post racing ``remove_peer`` fails with ``UnknownPeer`` (what the
    caller must act on), never with an ``InvalidHandle`` about a prep."""
    from kvt.errors import PeerDisconnected, UnknownPeer
    a, b, peer, _ = pair(backend, tcp=True)
    info = b.info()

    def post():
        with a.read_blocks(peer, [1], [3]) as x:
            x.wait(10)

    def churn():
        for _ in range(2000):
            a.remove_peer(peer)
            a.add_peer(info)

    with a, b:
        _race(post, churn, (UnknownPeer, PeerDisconnected))


def cancelled_await_is_released(backend: str) -> None:
    """A task awaiting a transfer to a frozen peer is cancelled: the transfer
    is released by the time the CancelledError reaches the caller, and its
    bytes never land, even once the peer runs again."""
    from kvt_conformance.peer import freeze
    from peer import BLOCK, NUM_BLOCKS, pattern, peer_process

    from kvt import registry
    # a peer on another host: a stopped process's memory is not read behind its back (shm, cma)
    # ucx cannot call back posted bytes: its release waits for the peer until this timeout
    opts = {"timeout": 15, **registry.load_backend(backend).capabilities.cross_host_options}
    with peer_process(backend=backend, options=opts, shared=backend == "host") as p, \
            Agent(name="me", backend=backend, options=opts) as me:
        mine = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [mine])
        name = me.connect(p.endpoint, timeout=20)
        me.read_blocks(name, [0], [0]).wait(20)
        freeze(p.proc.pid)
        try:
            x = me.read_blocks(name, [5], [5])

            async def main():
                task = asyncio.ensure_future(_await(x))
                await asyncio.sleep(0.2)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                else:
                    raise AssertionError("the awaited transfer was not cancelled")
                assert x.handle not in me.backend._xfers, "cancelled transfer still held by the backend"

            asyncio.run(main())
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        me.reconnect(name)  # ucx gave up on the silent peer when the release timed out
        me.read_blocks(name, [6], [6]).wait(30)  # the peer runs again and answers
        assert (mine[6] == pattern()[6]).all()
        assert not mine[5].any(), "bytes of the cancelled READ landed after the cancellation"


async def _await(x):
    await x


CASES = {f.__name__: f for f in (dropped_transfers_are_released, posting_survives_concurrent_refresh,
                                  removed_peer_is_unknown, cancelled_await_is_released)}

if __name__ == "__main__":
    backend, case = sys.argv[1:3]
    CASES[case](backend)
    print("ok")
