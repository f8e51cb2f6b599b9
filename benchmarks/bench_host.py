"""Host backend: cross-process READ bandwidth next to a same-run memcpy.

    python benchmarks/bench_host.py [--size-mib 256] [--iters 10]

The target process owns the source buffer (in kvt shared memory, and for the
``cma`` row in private heap memory); the initiator reads it into its own
warm buffer.  The memcpy row copies between two warm buffers of the same
size in the initiator.  Prints a markdown table; best of ``--iters``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np


def _target(nbytes: int, shared: bool, q, stop) -> None:
    from kvt import Agent, memory

    buf = memory.empty(nbytes) if shared else np.empty(nbytes, np.uint8)
    buf[:] = 7  # touch every page before timing
    with Agent(name="target", backend="host") as agent:
        agent.register_blocks("buf", [buf.reshape(1, -1)])
        q.put(agent.listen())
        stop.wait(120)


def _read_bw(endpoint: str, nbytes: int, iters: int, transport: str) -> float:
    from kvt import Agent

    dst = np.ones(nbytes, np.uint8)
    with Agent(name="initiator", backend="host", options={"transport": transport}) as agent:
        agent.register_blocks("buf", [dst.reshape(1, -1)])
        peer = agent.connect(endpoint)
        best = float("inf")
        for _ in range(iters + 1):  # first one warms up
            t = time.perf_counter()
            with agent.read_blocks(peer, [0], [0], layout="buf") as x:
                x.wait(60)
            best = min(best, time.perf_counter() - t)
        assert (dst[:: 4096] == 7).all(), "data did not arrive"
    return nbytes / best / 1e9


def _memcpy_bw(nbytes: int, iters: int) -> float:
    src, dst = np.full(nbytes, 7, np.uint8), np.ones(nbytes, np.uint8)
    best = float("inf")
    for _ in range(iters + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    nbytes = args.size_mib << 20
    ctx = mp.get_context("spawn")
    rows = [("memcpy (same process, baseline)", _memcpy_bw(nbytes, args.iters))]
    for label, shared, transport in [("host READ, shared-memory target (shm path)", True, "auto"),
                                     ("host READ, private-heap target (cma path)", False, "auto"),
                                     ("host READ, forced tcp (loopback)", True, "tcp")]:
        q, stop = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=_target, args=(nbytes, shared, q, stop), daemon=True)
        p.start()
        try:
            rows.append((label, _read_bw(q.get(timeout=60), nbytes, args.iters, transport)))
        finally:
            stop.set()
            p.join(10)
            if p.is_alive():
                p.kill()
    base = rows[0][1]
    print(f"\n{args.size_mib} MiB, 2 processes, best of {args.iters}\n")
    print("| path | GB/s | x memcpy |\n|---|---:|---:|")
    for label, bw in rows:
        print(f"| {label} | {bw:.2f} | {bw / base:.2f} |")


if __name__ == "__main__":
    main()
