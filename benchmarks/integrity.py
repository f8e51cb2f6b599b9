"""Cost of end-to-end integrity checks (kvt.integrity): the same block reads
between two agents with KVT_INTEGRITY off and on, side by side in one run.

    bench-quiet .venv/bin/python benchmarks/integrity.py [--block-kib 64] [--blocks 32] [--iters 200]

Prints the median time per read (wait() included) and the ratio; the peer
is another agent in this same process (host backend), so "on" pays for
digesting both ends and one side-channel round trip, both ends' hashing
sharing this process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per read")
    ap.add_argument("--layers", type=int, default=4, help="regions (one per layer)")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    from kvt import Agent, memory
    from kvt.config import load_config

    nb, bl = 256, args.block_kib * 1024
    src = [memory.empty((nb, bl)) for _ in range(args.layers)]
    for i, s in enumerate(src):
        s[:] = (np.arange(nb * bl, dtype=np.uint64).reshape(nb, bl) * (i + 3) >> 5).astype(np.uint8)
    results = {}
    # the prefill side serves digests only with integrity checks on (they cost it, not the asker)
    with Agent(name="prefill", config=load_config(backend="host", options={"timeout": 30}, integrity=True)) as p:
        p.register_blocks("kv", src)
        endpoint = p.listen()
        for on in (False, True, False, True):  # interleaved: drift hits both alike
            cfg = load_config(backend="host", options={"timeout": 30}, integrity=on)
            with Agent(name=f"decode-{on}", config=cfg) as d:
                dst = [memory.empty((nb, bl)) for _ in range(args.layers)]
                for x in dst:
                    x[:] = 0
                d.register_blocks("kv", dst)
                peer = d.connect(endpoint)
                rng = np.random.default_rng(1)
                times = []
                for i in range(args.iters + 10):
                    ids = rng.choice(nb, args.blocks, replace=False)
                    t0 = time.perf_counter()
                    with d.read_blocks(peer, ids, ids) as t:
                        t.wait(30)
                    if i >= 10:
                        times.append(time.perf_counter() - t0)
                results.setdefault(on, []).extend(times)
    mb = args.blocks * args.layers * bl / 1e6
    off, on = statistics.median(results[False]), statistics.median(results[True])
    print(f"read of {args.blocks} blocks x {args.layers} layers x {args.block_kib} KiB = {mb:.1f} MB, "
          f"{len(results[False])} reads each")
    print(f"  integrity off: {off * 1e3:8.3f} ms  ({mb / off / 1e3:.2f} GB/s)")
    print(f"  integrity on:  {on * 1e3:8.3f} ms  ({mb / on / 1e3:.2f} GB/s)")
    print(f"  on / off: {on / off:.2f}x")


if __name__ == "__main__":
    main()
