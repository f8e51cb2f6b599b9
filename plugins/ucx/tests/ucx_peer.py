"""A ucx-backend agent in another (spawned) process, for the two-process tests.

The peer registers a zeroed ``main`` buffer and an ``extra`` buffer, serves its
metadata through kvt's handshake channel, and answers commands over a pipe.
Every wait has a timeout; the peer exits when its parent's pipe closes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
from kvt_conformance.peer import freeze

NBYTES = 1 << 20   # main buffer
EXTRA = 1 << 16    # a second registration the tests can withdraw
_CMD_TIMEOUT = 60.0
#: UCX's TCP transport would listen on every network interface; tests stay on loopback
LOOPBACK_ONLY = {"NET_DEVICES": "lo"}
#: no cross-memory attach: RMA emulated over TCP, served by the target's progress thread
TCP_ONLY = {**LOOPBACK_ONLY, "TLS": "tcp,self"}
#: RMA emulated over shared memory (posix), no socket that would tell UCX the peer died
SHM_ONLY = {**LOOPBACK_ONLY, "TLS": "posix,self"}
BIG = 64 << 20     # main buffer of a peer started with nbytes=BIG


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(conn, name: str, options: dict, nbytes: int) -> None:
    from kvt.handshake import HandshakeServer
    from kvt.types import Descs
    from kvt_ucx import UcxBackend

    main, extra = np.zeros(nbytes, np.uint8), np.zeros(EXTRA, np.uint8)
    with UcxBackend(name, options) as backend:
        backend.register(Descs.from_buffers([main]))
        extra_reg = backend.register(Descs.from_buffers([extra]))
        server = HandshakeServer(lambda _request: backend.local_metadata()).start()
        conn.send((server.endpoint, main.ctypes.data, extra.ctypes.data))
        try:
            while conn.poll(_CMD_TIMEOUT):
                cmd, *args = conn.recv()
                if cmd == "stop":
                    return
                if cmd == "fill":
                    main[:] = pattern(args[0], NBYTES)
                    conn.send(True)
                elif cmd == "contents":
                    conn.send((main.tobytes(), extra.tobytes()))
                elif cmd == "write_to":  # post a WRITE of our whole main buffer into a peer; do not wait
                    from kvt.types import Op

                    md, addr = args
                    name = backend.add_remote(md)
                    lp = backend.prep(None, Descs.from_buffers([main]))
                    rp = backend.prep(name, Descs.from_regions([addr], [NBYTES]))
                    backend.transfer(Op.WRITE, lp, None, rp, None)
                    conn.send(True)
                elif cmd == "withdraw_extra":
                    backend.deregister(extra_reg)
                    conn.send(True)
                elif cmd == "await_notifs":  # each notification with the main buffer as it was on arrival
                    count, timeout = args
                    got, deadline = [], time.monotonic() + timeout
                    while len(got) < count and time.monotonic() < deadline:
                        for sender, msgs in backend.get_notifs().items():
                            got += [(sender, m, main.tobytes()) for m in msgs]
                        time.sleep(0.001)
                    conn.send(got)
        finally:
            server.close()


class Peer:
    """The test's handle on a peer process."""

    def __init__(self, proc, conn, endpoint: str, main_addr: int, extra_addr: int):
        self.proc, self._conn = proc, conn
        self.endpoint, self.main_addr, self.extra_addr = endpoint, main_addr, extra_addr

    def _ask(self, *cmd, timeout: float = _CMD_TIMEOUT):
        self._conn.send(cmd)
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]!r} within {timeout}s")
        return self._conn.recv()

    def metadata(self) -> bytes:
        from kvt.handshake import request

        return request(self.endpoint, b"metadata", 10.0)

    def fill(self, seed: int) -> np.ndarray:
        self._ask("fill", seed)
        return pattern(seed, NBYTES)

    def contents(self) -> tuple[np.ndarray, np.ndarray]:
        main, extra = self._ask("contents")
        return np.frombuffer(main, np.uint8), np.frombuffer(extra, np.uint8)

    def write_to(self, metadata: bytes, addr: int) -> None:
        """Post (not wait for) a WRITE of the peer's main buffer to ``addr`` at another agent."""
        self._ask("write_to", metadata, addr)

    def withdraw_extra(self) -> None:
        self._ask("withdraw_extra")

    def await_notifs(self, count: int, timeout: float = 20.0) -> list[tuple[str, bytes, np.ndarray]]:
        got = self._ask("await_notifs", count, timeout, timeout=timeout + 10)
        return [(s, m, np.frombuffer(b, np.uint8)) for s, m, b in got]

    def freeze(self) -> None:
        freeze(self.proc.pid)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


@contextmanager
def peer_process(name: str = "peer", nbytes: int = NBYTES, **options):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(theirs, name, {"timeout": 5.0, "ucx": LOOPBACK_ONLY, **options}, nbytes), daemon=True)
    proc.start()
    try:
        if not ours.poll(60):
            raise TimeoutError("peer process did not start within 60s")
        yield Peer(proc, ours, *ours.recv())
    finally:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGCONT)
                ours.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def settle(backend, handle, within: float):
    """Poll ``handle`` until it leaves PROC; fails the test after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        state = backend.check_state(handle)
        if not state.pending:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"transfer still PROC after {within}s")
        time.sleep(0.001)
