"""A victim owner in its own process for the hostile-peer tests: a host-backend
agent whose registered region sits between guard zones, so a test can prove
that no byte outside what was registered was read or written."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from peer import spawned

GUARD, REGION = 64 * 1024, 256 * 1024  # bytes each side, registered bytes
GUARD_BYTE = 0xA5
PRIVATE = b"PRIVATE!"  # what the owner writes into memory it deregistered


def _fill(region: np.ndarray) -> None:
    region[:] = (np.arange(region.size) * 7 % 251).astype(np.uint8)


def _serve(options, auth_key, q, cmd) -> None:
    import os
    if auth_key is not None:
        os.environ["KVT_AUTH_KEY"] = auth_key
    from kvt import Agent, memory

    buf = memory.empty(GUARD + REGION + GUARD)
    buf[:] = GUARD_BYTE
    region = buf[GUARD:GUARD + REGION]
    _fill(region)
    import tempfile
    secret = tempfile.TemporaryFile()  # a file the owner has open, never shared: forged segments aim at it
    secret.write(b"S" * REGION)
    secret.flush()
    with Agent(name="owner", backend="host", options=options) as agent:
        agent.register_blocks("kv", [region.reshape(64, -1)])
        q.put((agent.listen(), region.ctypes.data, REGION, secret.fileno()))
        while True:
            op = cmd.get(timeout=300)
            if op == "stop":
                return
            if op == "check":  # (guards intact, region unchanged)
                expect = np.empty_like(region)
                _fill(expect)
                guards = np.concatenate([buf[:GUARD], buf[GUARD + REGION:]])
                q.put((bool((guards == GUARD_BYTE).all()), bool((region == expect).all())))
            elif op == "secret":
                secret.seek(0)
                q.put(secret.read())
            elif op == "metadata":  # its data endpoint, for tests that may not fetch it by handshake
                q.put(agent.backend.local_metadata())
            elif op == "notifs":
                q.put({k: [len(m) for m in v] for k, v in agent.get_notifs().items()})
            elif op == "dereg_reuse":  # give the region up, then reuse its memory for bytes of our own
                agent.deregister(agent._layout_regs.pop("kv"))
                region[:] = np.frombuffer(PRIVATE * (REGION // len(PRIVATE)), np.uint8)
                q.put(True)
            elif op == "private":  # is the reused region still all ours?
                q.put(bool((region == np.frombuffer(PRIVATE * (REGION // len(PRIVATE)), np.uint8)).all()))


class Owner:
    def __init__(self, proc, q, cmd, endpoint, base, size, secret_fd):
        self.proc, self._q, self._cmd = proc, q, cmd
        self.endpoint, self.base, self.size, self.secret_fd = endpoint, base, size, secret_fd

    def ask(self, op: str):
        assert self.proc.is_alive(), f"the owner died (exit code {self.proc.exitcode})"
        self._cmd.put(op)
        return self._q.get(timeout=60)


@contextmanager
def owner_process(options=None, auth_key=None):
    with spawned(_serve, options or {}, auth_key) as (proc, q, cmd, first):
        yield Owner(proc, q, cmd, *first)
