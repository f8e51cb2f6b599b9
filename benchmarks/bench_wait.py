"""CPU a waiting thread burns: ``Transfer.wait()`` on a transfer that cannot
finish (the peer is frozen with SIGSTOP) for ``--seconds``, measured as the
whole initiator process's CPU time over that wait.

    python benchmarks/bench_wait.py [--seconds 1] [--backend host]

Two waits per backend, same run: ``wait()`` as kvt does it (the backend's
completion event where it has one), and the polling loop every backend falls
back to (``Backend.wait``'s default: spin briefly, then 1 ms sleeps), which
is what ``wait()`` did before events.  Prints a markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import time

import numpy as np


def _target(backend: str, q, stop) -> None:
    from kvt import Agent

    with Agent(name="frozen", backend=backend) as agent:
        agent.register_blocks("kv", [np.ones((4, 4096), np.uint8)])
        q.put(agent.listen())
        stop.wait(120)


def _cpu_of_wait(agent, peer: str, seconds: float, polling: bool) -> float:
    """Process CPU seconds per wall second while waiting ``seconds`` on a stuck READ."""
    from kvt.backend import Backend
    from kvt.errors import KvtTimeoutError

    x = agent.read_blocks(peer, [0], [1])
    c0, t0 = time.process_time(), time.perf_counter()
    if polling:
        state = Backend.wait(agent.backend, x.handle, seconds)
        assert state.pending, "the frozen peer answered"
    else:
        try:
            x.wait(seconds)
            raise AssertionError("the frozen peer answered")
        except KvtTimeoutError:
            pass
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return cpu / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--backend", default="host")
    args = ap.parse_args()
    from kvt import Agent

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_target, args=(args.backend, q, stop), daemon=True)
    p.start()
    rows = []
    try:
        endpoint = q.get(timeout=60)
        opts = {"transport": "tcp", "timeout": 60} if args.backend == "host" else {"timeout": 60}
        with Agent(name="waiter", backend=args.backend, options=opts) as agent:
            agent.register_blocks("kv", [np.zeros((4, 4096), np.uint8)])
            peer = agent.connect(endpoint)
            agent.read_blocks(peer, [0], [1]).wait(10)  # warm: connection up
            os.kill(p.pid, signal.SIGSTOP)
            time.sleep(0.2)
            for label, polling in (("wait() (completion event)", False), ("polling loop (before)", True)):
                rows.append((label, _cpu_of_wait(agent, peer, args.seconds, polling)))
            os.kill(p.pid, signal.SIGCONT)
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()
    print(f"\n{args.backend}: one READ stuck on a frozen peer, waited {args.seconds:g} s\n")
    print("| wait | CPU (fraction of one core) |\n|---|---:|")
    for label, frac in rows:
        print(f"| {label} | {frac * 100:.2f}% |")


if __name__ == "__main__":
    main()
