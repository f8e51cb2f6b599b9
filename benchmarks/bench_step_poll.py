"""Does an engine that asks for notifications every step starve kvt's threads?

An engine's step loop calls ``Agent.get_notifs()`` once per step, thousands
of times a second, on a thread that holds the GIL nearly all the time.  If
that call lets go of the GIL and takes it back microseconds later, every
other thread of the process (kvt's transfer workers, servers, handshakes)
is woken by each release, finds the GIL taken again when it gets to run on
its CPU, and waits anew; CPython forces a switch only after 5 ms (the switch
interval) without a release.  A 10-row tcp READ then took over 10 s under a
real vLLM (CI, 2026-12-07).  Baselines: the same loop without any kvt call,
and raw ``nixl_agent.get_new_notifs`` (NIXL's call lets go of the GIL).

With ``--in-flight`` each backend gets a second row: the step instead asks
``Transfer.state()`` of a 64 MiB READ from a peer process (64 blocks of 1
MiB), posting the next when it is done, as an engine polls its loads
(NIXL's ``getXferStatus`` lets go of the GIL too).

Measured here: the "engine" (the main thread, pinned to one CPU) loops
``get_notifs()`` plus ``--work`` iterations of Python per step; a helper
thread (pinned to another CPU, as kvt's workers run where the scheduler
puts them) sleeps 1 ms ``--wakes`` times and times each wake-up, which
includes getting the GIL back.  A wake-up within about one switch interval is fine; seconds are the
starvation.

    .venv/bin/python benchmarks/bench_step_poll.py --backends host,nixl,ucx
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time

import numpy as np
from kvt import Agent, Op, memory

_BLOCKS, _BLOCK = 64, 1 << 20  # --in-flight: one READ of 64 MiB


def run(step, wakes: int, work: int, limit: float) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpu, helper_cpu = cpus[-1], cpus[0]  # one CPU for both when there is only one
    done, lat = threading.Event(), []

    def helper() -> None:
        os.sched_setaffinity(0, {helper_cpu})
        for _ in range(wakes):
            t = time.perf_counter()
            time.sleep(0.001)
            lat.append(time.perf_counter() - t - 0.001)
            if done.is_set():
                return
        done.set()

    before = os.sched_getaffinity(0)
    threading.Thread(target=helper, daemon=True).start()
    os.sched_setaffinity(0, {engine_cpu})
    try:
        t0, steps = time.perf_counter(), 0
        while not done.is_set():
            step()
            for _ in range(work):
                pass
            steps += 1
            if time.perf_counter() - t0 > limit:
                done.set()
        seconds = time.perf_counter() - t0
    finally:
        os.sched_setaffinity(0, before)
    return {"wakes": len(lat), "median_ms": statistics.median(lat) * 1e3 if lat else float("nan"),
            "max_ms": max(lat) * 1e3 if lat else float("nan"), "seconds": seconds, "steps_per_s": steps / seconds}


def _kvt(backend: str):
    agent = Agent(name=f"step-poll-{backend}", backend=backend)
    return agent.get_notifs, agent.close


def _serve(backend: str, endpoints, stop) -> None:
    """The peer of ``--in-flight`` (a process of its own): registers the blocks, serves until told to stop."""
    with Agent(name="step-poll-peer", backend=backend) as peer:
        peer.register_blocks("kv", [memory.empty((_BLOCKS, _BLOCK))])
        endpoints.put(peer.listen())
        while not stop.wait(0.01):
            peer.get_notifs()


def _in_flight(backend: str):
    """A step that asks the state of a READ from a peer process, and posts the next once it is done;
    and a close.  Also counts posts and state() calls (printed with the row)."""
    ctx = multiprocessing.get_context("spawn")
    endpoints, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(backend, endpoints, stop), daemon=True)
    proc.start()
    agent = Agent(name=f"step-poll-{backend}", backend=backend)
    agent.register_blocks("kv", [memory.empty((_BLOCKS, _BLOCK))])
    peer = agent.connect(endpoints.get(timeout=60))
    ids, cur, counts = np.arange(_BLOCKS, dtype=np.int64), [None], {"posts": 0, "asked": 0}

    def step() -> None:
        if cur[0] is None:
            cur[0] = agent.transfer_blocks(Op.READ, peer, ids, ids, "kv")
            counts["posts"] += 1
            return
        counts["asked"] += 1
        if cur[0].state().done:
            cur[0].release()
            cur[0] = None

    def close() -> None:
        if cur[0] is not None:
            cur[0].wait(30)
            cur[0].release()
        agent.close()
        stop.set()
        proc.join(30)

    step.counts = counts
    return step, close


def _raw_nixl():
    """``nixl_agent.get_new_notifs`` as NIXL's Python API gives it, and a
    close.  No progress thread: nixl_agent's spins (it would take the
    helper's CPU); the call lets go of the GIL either way."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("step-poll-raw-nixl", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    return agent.get_new_notifs, lambda: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="host,nixl,ucx")
    ap.add_argument("--wakes", type=int, default=50)
    ap.add_argument("--work", type=int, default=1000, help="Python loop iterations per step besides get_notifs")
    ap.add_argument("--limit", type=float, default=10.0, help="seconds before a starved run is cut short")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--in-flight", action="store_true", help="also a row per backend polling a 64 MiB READ")
    args = ap.parse_args()
    print(f"{'engine loop':<22} {'wakes':>5} {'wake ms med':>11} {'wake ms max':>11} {'seconds':>8} {'steps/s':>9}")
    for _ in range(args.rounds):
        rows = [("baseline (no kvt)", lambda: (lambda: None, lambda: None))]
        for name in args.backends.split(","):
            if name == "nixl":
                rows.append(("raw nixl_agent", _raw_nixl))
            rows.append((f"{name} get_notifs", lambda name=name: _kvt(name)))
            if args.in_flight:
                rows.append((f"{name} READ in flight", lambda name=name: _in_flight(name)))
        for label, make in rows:
            step, close = make()
            try:
                r = run(step, args.wakes, args.work, args.limit)
            finally:
                close()
            counts = getattr(step, "counts", None)
            print(f"{label:<22} {r['wakes']:>5} {r['median_ms']:>11.2f} {r['max_ms']:>11.1f} {r['seconds']:>8.2f} "
                  f"{r['steps_per_s']:>9.0f}" + (f"  ({counts['posts']} READs posted, state() asked "
                                                 f"{counts['asked']} times)" if counts else ""), flush=True)


if __name__ == "__main__":
    main()
