"""CPU an idle NIXL agent's progress thread burns, with and without kvt's
progress delay (the nixl backend's ``progress_delay_us``).

    python benchmarks/bench_nixl_idle.py [--seconds 2] [--delays 0,1000]

For each delay a fresh process creates one ``NixlBackend`` (and so one
``nixl_agent`` with its UCX progress thread), sleeps ``--seconds`` and
reports its CPU time over that sleep as a fraction of one core.  Delay 0 is
``nixl_agent`` as it ships (``pthrDelay`` 0: the thread spins); kvt's default
is 1000 us.  Prints a markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

_IDLE = """
import resource, sys, time
from kvt_nixl.backend import NixlBackend
b = NixlBackend("idle", {"progress_delay_us": int(sys.argv[1])})
time.sleep(0.5)  # start-up settled
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep(float(sys.argv[2]))
r1 = resource.getrusage(resource.RUSAGE_SELF)
print((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (time.monotonic() - t0))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--delays", default="0,1000", help="progress_delay_us values, comma-separated")
    args = ap.parse_args()
    print("| progress_delay_us | idle agent's CPU, fraction of a core |")
    print("|---:|---:|")
    for delay in (int(d) for d in args.delays.split(",")):
        out = subprocess.run([sys.executable, "-c", _IDLE, str(delay), str(args.seconds)], capture_output=True,
                             text=True, timeout=120 + args.seconds, check=True).stdout
        print(f"| {delay} | {float(out.split()[-1]):.3f} |", flush=True)


if __name__ == "__main__":
    main()
