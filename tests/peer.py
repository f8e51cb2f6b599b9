"""A peer agent in another process, for tests (spawned, so it is a real
separate process with its own address space)."""

from __future__ import annotations

import multiprocessing as mp
from contextlib import contextmanager

import numpy as np

NUM_BLOCKS, BLOCK = 64, 4096


def pattern(num_blocks: int = NUM_BLOCKS, block: int = BLOCK, salt: int = 1) -> np.ndarray:
    """Known contents: every block distinct, every byte position distinct."""
    return ((np.arange(num_blocks * block, dtype=np.uint64) * 2654435761 + salt) >> 7).astype(np.uint8).reshape(
        num_blocks, block)


def _serve(name, backend, options, shared, kind, q, cmd) -> None:
    from kvt import Agent, memory

    buf = memory.empty((NUM_BLOCKS, BLOCK)) if shared else np.empty((NUM_BLOCKS, BLOCK), np.uint8)
    buf[:] = pattern()
    if kind is not None:  # a torch view, registered as another memory kind (staging test double)
        import torch
        buf = torch.from_numpy(buf)
    with Agent(name=name, backend=backend, options=options) as agent:
        agent.register_blocks("kv", [buf], kind=kind)
        q.put(agent.listen())
        while True:  # answer the test's questions about our memory
            op = cmd.get(timeout=120)
            if op == "stop":
                return
            if op == "contents":
                q.put(np.asarray(buf).tobytes())
            elif op == "await_notif":  # snapshot memory the moment a notification is seen
                sender, msg = agent.wait_notif(timeout=30)
                q.put((sender, msg, np.asarray(buf).tobytes()))
            elif op == "notifs":
                q.put(agent.get_notifs())
            elif op == "deregister":  # drop the registration, keep the memory (stale-metadata tests)
                agent.deregister(agent._layout_regs.pop("kv"))
                q.put(True)


class Peer:
    def __init__(self, proc, q, cmd, endpoint):
        self.proc, self._q, self._cmd, self.endpoint = proc, q, cmd, endpoint

    def contents(self) -> np.ndarray:
        self._cmd.put("contents")
        return np.frombuffer(self._q.get(timeout=30), np.uint8).reshape(NUM_BLOCKS, BLOCK)

    def await_notif(self):
        """(sender, msg, contents at the moment the notification arrived)."""
        self._cmd.put("await_notif")
        sender, msg, raw = self._q.get(timeout=60)
        return sender, msg, np.frombuffer(raw, np.uint8).reshape(NUM_BLOCKS, BLOCK)

    def deregister(self) -> None:
        self._cmd.put("deregister")
        self._q.get(timeout=30)

    def notifs(self) -> dict:
        self._cmd.put("notifs")
        return self._q.get(timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


@contextmanager
def spawned(target, *args):
    """``target(*args, q, cmd)`` in a spawned process: yields the process, its
    reply and command queues and its first reply; stopped ("stop", then kill) after."""
    ctx = mp.get_context("spawn")
    q, cmd = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q, cmd), daemon=True)
    proc.start()
    try:
        yield proc, q, cmd, q.get(timeout=60)
    finally:
        if proc.is_alive():
            cmd.put("stop")
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@contextmanager
def peer_process(name="peer", backend="host", options=None, shared=True, kind=None):
    with spawned(_serve, name, backend, options or {}, shared, kind) as (proc, q, cmd, first):
        yield Peer(proc, q, cmd, first)
