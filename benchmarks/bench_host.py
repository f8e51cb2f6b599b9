"""Host backend: cross-process READ bandwidth next to a same-run memcpy.

    python benchmarks/bench_host.py [--size-mib 256] [--iters 10]

The target process owns the source buffer (in kvt shared memory, and for the
``cma`` row in private heap memory); the initiator reads it into its own
warm buffer.  The baseline is a memcpy between two warm buffers of the same
size in the initiator, alternating with the reads.  Prints a markdown
table; best of ``--iters`` for each.
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


def _read_bw(endpoint: str, nbytes: int, iters: int, transport: str) -> tuple[float, float]:
    """(READ GB/s, memcpy GB/s): best of ``iters`` each, the two alternating
    in this process so that both see the same machine (it is noisy)."""
    from kvt import Agent

    dst = np.ones(nbytes, np.uint8)
    a, b = np.full(nbytes, 7, np.uint8), np.ones(nbytes, np.uint8)
    with Agent(name="initiator", backend="host", options={"transport": transport}) as agent:
        agent.register_blocks("buf", [dst.reshape(1, -1)])
        peer = agent.connect(endpoint)
        best_read = best_copy = float("inf")
        for _ in range(iters + 1):  # the first round warms up
            t = time.perf_counter()
            np.copyto(b, a)
            best_copy = min(best_copy, time.perf_counter() - t)
            t = time.perf_counter()
            with agent.read_blocks(peer, [0], [0], layout="buf") as x:
                x.wait(60)
            best_read = min(best_read, time.perf_counter() - t)
        assert (dst[:: 4096] == 7).all(), "data did not arrive"
    return nbytes / best_read / 1e9, nbytes / best_copy / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    nbytes = args.size_mib << 20
    ctx = mp.get_context("spawn")
    rows = []
    for label, shared, transport in [("host READ, shared-memory target (shm path)", True, "auto"),
                                     ("host READ, private-heap target (cma path)", False, "auto"),
                                     ("host READ, forced tcp (loopback)", True, "tcp")]:
        q, stop = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=_target, args=(nbytes, shared, q, stop), daemon=True)
        p.start()
        try:
            rows.append((label, *_read_bw(q.get(timeout=60), nbytes, args.iters, transport)))
        finally:
            stop.set()
            p.join(10)
            if p.is_alive():
                p.kill()
    print(f"\n{args.size_mib} MiB, 2 processes, best of {args.iters}; memcpy measured in the initiator, "
          "alternating with the reads\n")
    print("| path | READ GB/s | memcpy GB/s | x memcpy |\n|---|---:|---:|---:|")
    for label, bw, base in rows:
        print(f"| {label} | {bw:.2f} | {base:.2f} | {bw / base:.2f} |")


if __name__ == "__main__":
    main()
