"""A peer agent in another process (multiprocessing 'spawn': its own address
space and its own NIXL/UCX instance), driven over a pipe.  It serves its
metadata through kvt's handshake, like a real deployment; the pipe only
carries the test's commands and the peer's memory contents back."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
from kvt_conformance.peer import freeze

NUM_BLOCKS, BLOCK = 64, 4096


def pattern(salt: int = 1) -> np.ndarray:
    """Known contents, different in every block (salt: another pattern)."""
    x = (np.arange(NUM_BLOCKS * BLOCK, dtype=np.uint64) * 2654435761 + salt) >> 7
    return x.astype(np.uint8).reshape(NUM_BLOCKS, BLOCK)


def _serve(name: str, options: dict, conn) -> None:
    from kvt.handshake import HandshakeServer, request
    from kvt.types import Descs
    from kvt_nixl.backend import NixlBackend

    backend = NixlBackend(name, options)
    buf = np.empty((NUM_BLOCKS, BLOCK), np.uint8)
    buf[:] = pattern()
    backend.register(Descs.from_buffers([buf]))
    server = HandshakeServer(lambda _req: backend.local_metadata()).start()
    conn.send((server.endpoint, os.getpid(), buf.ctypes.data))
    inbox: dict[str, list[bytes]] = {}

    def pull() -> None:
        for sender, msgs in backend.get_notifs().items():
            inbox.setdefault(sender, []).extend(msgs)

    try:
        while conn.poll(120):  # a test never idles this long: the parent is gone
            cmd, *args = conn.recv()
            if cmd == "stop":
                return
            try:
                if cmd == "contents":
                    out = buf.tobytes()
                elif cmd == "reset":  # between tests sharing this peer
                    buf[:] = pattern()
                    pull()
                    inbox.clear()
                    out = None
                elif cmd == "load":  # fetch the test agent's metadata through its handshake server
                    out = backend.add_remote(request(args[0], b"metadata", 10.0))
                elif cmd == "notify":
                    out = backend.notify(args[0], args[1])
                elif cmd == "await_notif":  # snapshot memory the moment a notification is seen
                    sender, msg, deadline = args[0], args[1], time.monotonic() + 20
                    while msg not in inbox.get(sender, ()) and time.monotonic() < deadline:
                        pull()
                    out = buf.tobytes() if msg in inbox.get(sender, ()) else None
                    if out is not None:
                        inbox[sender].remove(msg)
                elif cmd == "take":  # the first `count` messages from `sender`, waiting up to 20 s
                    sender, count, deadline = args[0], args[1], time.monotonic() + 20
                    while len(inbox.get(sender, ())) < count and time.monotonic() < deadline:
                        pull()
                    got = inbox.get(sender, [])
                    out, inbox[sender] = got[:count], got[count:]
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", out))
            except Exception as e:  # reported to the test
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        server.close()
        backend.close()


class Peer:
    """The test's side of a peer process."""

    def __init__(self, name: str, options: dict | None = None):
        ctx = mp.get_context("spawn")
        self.name, self.frozen = name, False
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(name, dict(options or {}), child), daemon=True)
        self.proc.start()
        child.close()
        self.endpoint, self.pid, self.addr = self._recv(60)

    def _recv(self, timeout: float):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer within {timeout}s")
        return self._conn.recv()

    def call(self, cmd: str, *args, timeout: float = 30.0):
        self._conn.send((cmd, *args))
        status, out = self._recv(timeout)
        if status != "ok":
            raise AssertionError(f"peer {self.name} failed {cmd}: {out}")
        return out

    def contents(self) -> np.ndarray:
        return np.frombuffer(self.call("contents"), np.uint8).reshape(NUM_BLOCKS, BLOCK)

    def blocks(self, ids, block: int = BLOCK):
        """Descriptors of blocks ``ids`` of the peer's buffer."""
        from kvt.types import Descs
        return Descs.from_blocks(self.addr, block, ids)

    def freeze(self) -> None:
        self.frozen = True
        freeze(self.pid)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive() and not self.frozen:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        self.kill()
        self._conn.close()


def load(backend, peer: Peer) -> str:
    """Fetch ``peer``'s metadata through kvt's handshake and load it."""
    from kvt.handshake import request

    return backend.add_remote(request(peer.endpoint, b"metadata", 10.0))


def settle(backend, handle, timeout: float = 15.0):
    """Poll until the transfer leaves PROC; fail (not hang) if it never does."""
    deadline = time.monotonic() + timeout
    while (state := backend.check_state(handle)).pending:
        assert time.monotonic() < deadline, f"transfer {handle} still PROC after {timeout}s"
        time.sleep(0.0005)
    return state


def serve_agent(name: str, conn) -> None:
    """A kvt ``Agent`` on the nixl backend serving one layout ``kv`` (the
    pattern) until the test sends "stop"; "contents" returns its memory."""
    from kvt import Agent

    buf = np.empty((NUM_BLOCKS, BLOCK), np.uint8)
    buf[:] = pattern()
    with Agent(name=name, backend="nixl", options={"timeout": 5.0}) as agent:
        agent.register_blocks("kv", [buf])
        conn.send(agent.listen())
        while conn.poll(120):
            cmd = conn.recv()
            if cmd == "stop":
                return
            if cmd == "contents":
                conn.send(buf.tobytes())
            elif cmd == "notif":
                conn.send(agent.wait_notif(timeout=20))
