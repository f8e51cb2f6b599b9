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
import os
import statistics
import threading
import time

from kvt import Agent


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
    args = ap.parse_args()
    print(f"{'engine loop':<22} {'wakes':>5} {'wake ms med':>11} {'wake ms max':>11} {'seconds':>8} {'steps/s':>9}")
    for _ in range(args.rounds):
        rows = [("baseline (no kvt)", lambda: (lambda: None, lambda: None))]
        for name in args.backends.split(","):
            if name == "nixl":
                rows.append(("raw nixl_agent", _raw_nixl))
            rows.append((f"{name} get_notifs", lambda name=name: _kvt(name)))
        for label, make in rows:
            step, close = make()
            try:
                r = run(step, args.wakes, args.work, args.limit)
            finally:
                close()
            print(f"{label:<22} {r['wakes']:>5} {r['median_ms']:>11.2f} {r['max_ms']:>11.1f} {r['seconds']:>8.2f} "
                  f"{r['steps_per_s']:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
