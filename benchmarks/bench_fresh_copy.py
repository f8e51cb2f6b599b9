"""The copy an engine's load makes: KV another process has just written.

    python benchmarks/bench_fresh_copy.py [--rounds 60] [--blocks 64] [--tensors 8] [--block-kib 32]
        [--idle-ms 1,5,20]

The reference engine's decode side copies blocks the prefill process wrote
a moment before; a plain ``kvt bench`` re-reads a source no other core
touches (it stays in cache), and ``kvt bench --cold`` one that was pushed
out to memory.  This times ``kvt.memcopy.copy`` (the copy engine the host
backend uses; two threads when the native engine splits the request) of
``--tensors`` x ``--blocks`` rows of ``--block-kib`` KiB out of a shared
mapping, after each of:

- *just written*: a child process wrote those rows (as the prefill side);
- *written, then evicted*: the child wrote them, then 64 MiB elsewhere;
- *clean, cached*: nobody wrote them since the last copy;

each after a 3 ms pause (the copy helpers park, as between an engine's
steps), and then, with nobody writing them:

- *clean, back to back*: right after the last copy (the warm bench);
- *clean, N ms asleep* / *clean, N ms spinning*: N ms after the last copy
  (``--idle-ms``), the process sleeping or busy on its CPU meanwhile.  If
  the copy slows down as much spinning as asleep, it is the data that went
  cold (on a VM, in a cache shared with the host's other tenants), not the
  CPU that halted.

The cases interleave, round after round, so a VM's swings between periods
reach all of them alike.  Prints the median and quartiles of each, and
memcpy (numpy) of the same bytes from the cached source as a baseline.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

from kvt import memcopy

#: name -> (what the writer does first: b"w" write, b"e" write and evict, b"" nothing; s asleep; s spinning)
CASES = {"just written": (b"w", 0.003, 0.0), "written, then evicted": (b"e", 0.003, 0.0),
         "clean, cached": (b"", 0.003, 0.0), "clean, back to back": (b"", 0.0, 0.0)}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60, help="timed rounds (one more runs first, untimed)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per tensor (the request's)")
    ap.add_argument("--tensors", type=int, default=8, help="layers x 2 (K and V)")
    ap.add_argument("--block-kib", type=int, default=32, help="one layer's K or V of one block")
    ap.add_argument("--idle-ms", default="1,5,20", help="pauses after the last copy, asleep and spinning")
    args = ap.parse_args()
    cases = dict(CASES)
    for ms in (float(x) for x in args.idle_ms.split(",") if x):
        cases[f"clean, {ms:g} ms asleep"] = (b"", ms / 1e3, 0.0)
        cases[f"clean, {ms:g} ms spinning"] = (b"", 0.0, ms / 1e3)
    bl, per = args.block_kib << 10, 2 * args.blocks * (args.block_kib << 10)  # each tensor twice the request
    src_map, evict_map = mmap.mmap(-1, args.tensors * per), mmap.mmap(-1, 64 << 20)  # shared with the child
    src = np.frombuffer(src_map, np.uint8)
    dst = np.ones(args.tensors * per, np.uint8)
    dst2 = np.ones_like(dst)  # the baseline's: its stores stay out of the copies' destination
    rows = (np.arange(args.tensors)[:, None] * per + np.arange(args.blocks)[None, :] * bl).ravel().astype(np.uint64)
    src_rows, dst_rows = rows + np.uint64(src.ctypes.data), rows + np.uint64(dst.ctypes.data)
    used = [slice(t * per, t * per + args.blocks * bl) for t in range(args.tensors)]
    ask_r, ask_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer: fills the used rows (and, asked to, 64 MiB more) on request
        os.close(ask_w), os.close(done_r)
        evict, k = np.frombuffer(evict_map, np.uint8), 0
        while (cmd := os.read(ask_r, 1)) in (b"w", b"e"):
            k += 1
            for s in used:
                src[s] = k & 0xFF
            if cmd == b"e":
                evict[:] = k & 0xFF
            os.write(done_w, b".")
        os._exit(0)
    os.close(ask_r), os.close(done_w)
    times: dict[str, list[float]] = {c: [] for c in cases}
    base: list[float] = []
    nbytes = args.tensors * args.blocks * bl
    try:
        for r in range(args.rounds + 1):  # round 0 untimed: it starts the copy helpers and faults pages in
            for case, (write, asleep, spinning) in cases.items():
                memcopy.copy(dst_rows, src_rows, bl)  # "the last copy" every case's pause counts from
                if write:
                    os.write(ask_w, write)
                    if os.read(done_r, 1) != b".":
                        raise SystemExit("the writer process died")
                time.sleep(asleep)
                _spin(spinning)
                t = time.perf_counter()
                memcopy.copy(dst_rows, src_rows, bl)
                if r:
                    times[case].append(time.perf_counter() - t)
            t = time.perf_counter()
            for s in used:
                dst2[s] = src[s]
            if r:
                base.append(time.perf_counter() - t)
    finally:
        os.write(ask_w, b"q")
        os.waitpid(pid, 0)
    print(f"{args.tensors} x {args.blocks} rows of {args.block_kib} KiB ({nbytes / 2**20:g} MiB), "
          f"{args.rounds} rounds, copy engine {memcopy.ENGINE}, {memcopy.THREADS} thread(s) at most\n")
    print("| source | median ms | p25 ms | p75 ms | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for case, ts in [*times.items(), ("numpy memcpy, clean, cached", base)]:
        q = statistics.quantiles(ts, n=4, method="inclusive")
        print(f"| {case} | {1e3 * statistics.median(ts):.3f} | {1e3 * q[0]:.3f} | {1e3 * q[2]:.3f} | "
              f"{nbytes / statistics.median(ts) / 1e9:.1f} |")


if __name__ == "__main__":
    main()
