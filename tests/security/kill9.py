"""Kill -9 a peer in the middle of a READ, RUNS times; run as a subprocess by
test_kill9.py (so a survivor that aborts shows as an exit code).

    python kill9.py BACKEND RUNS TIMEOUT

Each run: a fresh peer process registers 64 blocks of 4 KiB; we freeze it
(SIGSTOP, so the READ is surely in flight: tcp needs the peer's server,
NIXL's notification needs the peer's progress) and post a notifying READ of
all blocks, then kill -9 it.  That READ, and a READ posted after the kill,
must both settle within TIMEOUT + slack; the second must be ERR; no READ may
stay PROC.  Prints one JSON line per run, exit 0 iff every run held.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

SLACK = 10.0


def settle(t, limit):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        s = t.state()
        if not s.pending:
            return s
        time.sleep(0.005)
    return t.state()


def main() -> int:
    from kvt import Agent
    from kvt_conformance.peer import freeze
    from peer import BLOCK, NUM_BLOCKS, peer_process

    backend, runs, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    options = {"timeout": timeout} | ({"transport": "tcp"} if backend == "host" else {})
    ok = True
    buf = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
    with Agent(name="survivor", backend=backend, options=options) as me:
        me.register_blocks("kv", [buf])
        for run in range(runs):
            with peer_process(f"victim{run}", backend, options) as victim:
                name = me.connect(victim.endpoint, timeout=30)
                freeze(victim.proc.pid)  # every thread stopped: a bare SIGSTOP lets one answer for a moment
                start = time.monotonic()
                inflight = me.read_blocks(name, range(NUM_BLOCKS), range(NUM_BLOCKS), notif=b"x")
                time.sleep(0.1)
                os.kill(victim.proc.pid, signal.SIGKILL)
                victim.proc.join(10)
                first = settle(inflight, timeout + SLACK)
                after = settle(me.read_blocks(name, [0], [0]), timeout + SLACK)
                took = time.monotonic() - start
                held = (first.failed and after.failed and took < 2 * (timeout + SLACK))
                ok &= held
                print(json.dumps({"run": run, "inflight": repr(first)[:120], "after": repr(after)[:120],
                                  "seconds": round(took, 2), "held": held}), flush=True)
                me.remove_peer(name)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
