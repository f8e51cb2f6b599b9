"""Why ``kvt bench`` rotates even warm cases over 1 MiB: the same one-block
READ, in fresh process pairs, through ``Agent`` and as a bare
``process_vm_readv`` of the same bytes between the same two processes.

    python benchmarks/bench_block_placement.py [--backend ucx] [--pairs 6] [--block 256K]

Each pair allocates its buffers anew, so each draws new physical pages; the
bare syscall shows how much of a row is where those pages fall in the
cache, and the difference what the engine adds.  One line per pair.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time

import numpy as np

ITERS = 2000


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _target(backend: str, block: int, q, stop) -> None:
    from kvt import Agent
    from kvt.bench.buffers import TARGET_FILL, arena, block_view

    buf = arena(block * 4, TARGET_FILL)
    with Agent(name="placement-target", backend=backend) as agent:
        agent.register_blocks("kv", [block_view(buf, block)])
        q.put((agent.listen(), os.getpid(), buf.ctypes.data))
        while not stop.wait(0.001):  # an engine's step loop
            agent.get_notifs()


def one_pair(backend: str, block: int) -> tuple[float, float]:
    """Median seconds of the READ through ``Agent`` and of the bare syscall."""
    from kvt import Agent, Op
    from kvt.bench.buffers import INITIATOR_FILL, arena, block_view

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_target, args=(backend, block, q, stop), daemon=True)
    p.start()
    try:
        endpoint, pid, raddr = q.get(timeout=60)
        buf = arena(block * 4, INITIATOR_FILL)
        libc = ctypes.CDLL(None, use_errno=True)
        local, remote = _Iovec(buf.ctypes.data, block), _Iovec(raddr, block)
        ids = np.zeros(1, np.int64)
        via_agent, bare = [], []
        with Agent(name="placement-initiator", backend=backend) as agent:
            agent.register_blocks("kv", [block_view(buf, block)])
            peer = agent.connect(endpoint)
            for _ in range(ITERS):
                t0 = time.perf_counter()
                x = agent.transfer_blocks(Op.READ, peer, ids, ids, "kv")
                x.wait(10)
                t1 = time.perf_counter()
                x.release()
                t2 = time.perf_counter()
                n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                t3 = time.perf_counter()
                if n != block:
                    raise OSError(ctypes.get_errno(), "process_vm_readv")
                via_agent.append(t1 - t0)
                bare.append(t3 - t2)
        return float(np.median(via_agent)), float(np.median(bare))
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()


def main() -> None:
    from kvt.bench import format_size, parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--block", default="256K")
    args = ap.parse_args()
    block = parse_size(args.block)
    print(f"| pair | {args.backend} READ {format_size(block)} x1 via Agent, us | bare process_vm_readv, us |")
    print("|---:|---:|---:|")
    for i in range(args.pairs):
        a, b = one_pair(args.backend, block)
        print(f"| {i + 1} | {a * 1e6:.1f} | {b * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
