"""The Agent API as its callers use it: asyncio cancellation, threads,
misuse of a Transfer, timeouts, use after close.  Real backends: host in
this process; nixl and ucx each in a process of their own (their wheels
bundle different libucx builds)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvt import Agent
from kvt.agent import poll_until
from kvt.errors import ClosedError, InvalidArgument, KvtTimeoutError
from kvt_conformance.peer import freeze

import agent_audit_cases as cases
from peer import BLOCK, NUM_BLOCKS, pattern, peer_process

pytestmark = pytest.mark.timeout(300)


def _in_process(backend: str, case: str) -> None:
    out = subprocess.run([sys.executable, cases.__file__, backend, case], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def _run(backend: str, case: str) -> None:
    if backend == "host":
        getattr(cases, case)(backend)
    else:
        _in_process(backend, case)


BACKENDS = ["host", "nixl", "ucx"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_transfers_are_released(backend):
    _run(backend, "dropped_transfers_are_released")


@pytest.mark.parametrize("backend", BACKENDS)
def test_posting_survives_concurrent_refresh(backend):
    _run(backend, "posting_survives_concurrent_refresh")


@pytest.mark.parametrize("backend", BACKENDS)
def test_post_racing_remove_peer_says_unknown_peer(backend):
    _run(backend, "removed_peer_is_unknown")


@pytest.mark.parametrize("backend", ["host", "ucx"])  # nixl reads a stopped peer's memory all the same
def test_cancelled_await_is_released_and_its_bytes_never_land(backend):
    _run(backend, "cancelled_await_is_released")


@pytest.fixture
def frozen():
    """(agent, peer name, freeze()) with a host peer reached over TCP: frozen, it answers nothing."""
    with peer_process() as p, Agent(name="me", options={"timeout": 60, "transport": "tcp"}) as me:
        me.register_blocks("kv", [np.zeros((NUM_BLOCKS, BLOCK), np.uint8)])
        name = me.connect(p.endpoint, timeout=20)
        me.read_blocks(name, [0], [0]).wait(20)
        try:
            yield me, name, lambda: freeze(p.proc.pid)
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)


@pytest.mark.timeout(40)  # asyncio.run waiting out an abandoned wait (65 s here) is the failure
def test_wait_for_timeout_releases_and_leaves_nothing_running(frozen):
    me, name, freeze_peer = frozen
    freeze_peer()
    handles = []

    async def main():
        x = me.read_blocks(name, [3], [3])
        handles.append(x.handle)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_await(x), 0.5)
        assert x.handle not in me.backend._xfers

    asyncio.run(main())
    assert handles and not any(t.name.startswith("asyncio") for t in threading.enumerate() if t.is_alive())


def test_awaits_on_a_frozen_peer_do_not_starve_the_event_loop(frozen):
    """Many tasks await transfers to a frozen peer; the loop's default
    executor (6 threads on 2 cores) still runs other work at once."""
    me, name, freeze_peer = frozen
    freeze_peer()

    async def main():
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(_await(me.read_blocks(name, [i], [i]))) for i in range(1, 13)]
        await asyncio.sleep(0.3)
        try:
            assert await asyncio.wait_for(loop.run_in_executor(None, int, "7"), 20) == 7
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_several_concurrent_awaits_on_one_agent():
    """32 tasks await reads from a peer process at once; each lands its block."""
    with peer_process() as p, Agent(name="me", options={"timeout": 30, "transport": "tcp"}) as me:
        mine = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [mine])
        name = me.connect(p.endpoint, timeout=20)

        async def main():
            await asyncio.gather(*(_await(me.read_blocks(name, [i], [63 - i])) for i in range(32)))

        asyncio.run(main())
    assert (mine[:32] == pattern()[63:31:-1]).all()


async def _await(x):
    await x


# -- timeouts ---------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", True])
def test_wait_refuses_a_timeout_that_is_not_finite_seconds(frozen, bad):
    me, name, freeze_peer = frozen
    freeze_peer()
    with me.read_blocks(name, [2], [2]) as x:
        with pytest.raises(InvalidArgument, match="timeout"):
            x.wait(bad)
        with pytest.raises(KvtTimeoutError):  # zero and negative: look once
            x.wait(0)
        with pytest.raises(KvtTimeoutError):
            x.wait(-1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1"])
def test_wait_notif_poll_until_and_connect_refuse_a_timeout_that_is_not_finite_seconds(bad):
    with Agent(name="a") as a:
        with pytest.raises(InvalidArgument, match="timeout"):
            a.wait_notif(timeout=bad)
    with pytest.raises(InvalidArgument, match="timeout"):
        poll_until(lambda: False, bad, "nothing")
    with Agent(name="a") as a, Agent(name="b") as b:
        with pytest.raises(InvalidArgument, match="timeout"):
            a.connect(b.listen(), timeout=bad)


# -- misuse and use after close --------------------------------------------------


def _two():
    a, b = Agent(name="a"), Agent(name="b")
    a.register_blocks("kv", [np.zeros((4, 4096), np.uint8)])
    b.register_blocks("kv", [np.zeros((4, 4096), np.uint8)])
    return a, b, a.add_peer(b.info())


def test_release_after_close_is_quiet_and_use_after_close_is_closed_error():
    a, b, peer = _two()
    with b:
        x, y = a.read_blocks(peer, [0], [1]), a.read_blocks(peer, [1], [0])
        x.wait(10)
        a.close()
        x.release()  # cleanup after close: close released it already
        with x:
            pass
        for call in (y.state, lambda: y.wait(1), lambda: a.read_blocks(peer, [0], [1]),
                     lambda: a.wait_notif(timeout=1), a.get_notifs, lambda: a.notify(peer, b"m"),
                     lambda: a.remove_peer(peer), lambda: a.deregister(1)):
            with pytest.raises(ClosedError):
                call()
        a.close()  # twice: nothing


def test_wait_after_release_says_released():
    a, b, peer = _two()
    with a, b:
        x = a.read_blocks(peer, [0], [1])
        x.wait(10)
        x.release()
        x.release()
        from kvt.errors import InvalidHandle
        with pytest.raises(InvalidHandle, match="released"):
            x.wait(1)
        with pytest.raises(InvalidHandle, match="released"):
            x.state()
        t = x.telemetry
        assert t.nbytes == 4096 and t.descs == 1 and t.post_s >= 0 and t.xfer_s is not None and t.xfer_s >= 0


def test_close_from_several_threads_at_once():
    a, b, peer = _two()
    with b:
        errors = []
        start = threading.Barrier(4)

        def close():
            start.wait(10)
            try:
                a.close()
            except Exception as e:  # noqa: BLE001 - any escape is the failure
                errors.append(e)

        threads = [threading.Thread(target=close) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors


class _FailedBackendDouble:
    """Test double: a backend whose every transfer has ended ERR."""

    def __init__(self):
        from kvt.errors import TransferError
        from kvt.types import XferState
        self.state = XferState.err(TransferError("the double's transfer failed"))

    def check_state(self, handle):
        return self.state


def test_waiting_again_on_a_failed_transfer_does_not_grow_its_traceback():
    """An engine polls ``wait(0)`` on a failed transfer until it handles it:
    each raise of the one stored cause must not add to its traceback (the
    frames it keeps alive)."""
    from kvt.agent import Transfer
    from kvt.errors import TransferError
    a, b, _ = _two()
    with a, b:
        x = Transfer(a, 1, 4096)
        x._backend = _FailedBackendDouble()
        depths = []
        for _ in range(50):
            with pytest.raises(TransferError) as e:
                x.wait(0)
            tb, n = e.value.__traceback__, 0
            while tb is not None:
                tb, n = tb.tb_next, n + 1
            depths.append(n)
        assert depths[-1] == depths[0], depths
