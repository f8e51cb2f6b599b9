"""Reference engine (``kvt demo --engine``): median load time per request
next to ``kvt bench`` moving the same blocks on the same backend, in one run.

    python benchmarks/bench_engine_load.py [--backends host,nixl,ucx] [--requests 12] [--rounds 1]
        [--blocks 64] [--layers 4] [--heads 8] [--head-dim 128] [--block-size 16] [--integrity]

The engine runs ``--requests`` requests of exactly ``--blocks`` blocks, one
at a time (each admitted once the one before finished), so a request's load
time is its own: decode read scheduled -> reported loaded, through the
connector (``start_load_kv`` posts, ``get_finished`` notices) and the worker
process's step.  The toy model's cache is split K/V per layer, so a request
reads ``layers x 2 x blocks`` descriptors of ``heads x block_size x
head_dim`` float16 values; ``kvt bench`` then moves exactly that (one READ
of that many blocks of that size, two fresh processes, ``--groups sweep``).
Prints a markdown table; the ratio is engine / bench, once against a plain
``kvt bench`` run (which moves the same blocks every iteration: a request
that fits the CPU cache is timed from cache) and once against ``kvt bench
--cold`` (different blocks each iteration, as an engine's loads are).
"worker posted -> landed" is the decode worker's own view of each read
(``take_timings``): the rest of the load time is the engine's step around it.
Each backend runs twice: with every worker a process of its own (the
scheduler talks to it over a pipe, as vLLM's multiprocess executor), then
with the decode worker in the decode scheduler's process (as vLLM runs tp=1;
the prefill worker stays a process of its own, so the KV still comes from
another process).
``--rounds N`` repeats the engine runs and the benches, alternately, and
ends with the median of the rounds' ratios: on a VM whose speed swings
between periods, one round is a draw.
``--integrity`` instead runs the engine with integrity checks off, then on
(``KVT_INTEGRITY=1``: each read proven against the prefill side's digests).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvt.connector.reference import EngineSpec, RequestSpec, ToyModel, run_pd


def engine_loads(backend: str, args: argparse.Namespace, in_process: bool = False
                 ) -> tuple[list[float], list[float], int]:
    """Load seconds of each request after the first (warm-up), the decode
    worker's posted -> landed seconds of each, and the bytes one request reads.
    ``in_process``: the decode worker in the decode scheduler's process (as
    vLLM runs tp=1), so run in a child process of its own: this one must not
    load two backends' bundled libucx."""
    if in_process:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            return child.submit(_engine_loads, backend, args, True).result(timeout=600)
    return _engine_loads(backend, args, False)


def _engine_loads(backend: str, args: argparse.Namespace, in_process: bool) -> tuple[list[float], list[float], int]:
    model = ToyModel(layers=args.layers, kv_heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
                     name="bench")
    engine = {"model": model, "num_blocks": 2 * args.blocks + 8, "backend": backend}
    specs = [RequestSpec(f"r{i}", args.blocks * args.block_size, barrier=True) for i in range(args.requests + 1)]
    report = run_pd(EngineSpec("prefill", **engine), EngineSpec("decode", **engine, in_process=in_process), specs,
                    timeout=300)
    results = list(report.results.values())
    bad = [r for r in results if r.status != "ok" or r.mismatches]
    if bad or report.leaks:
        raise SystemExit(f"{backend}: the engine run failed: {bad[:2]} leaks {report.leaks}")
    if any(r.loaded_blocks != args.blocks for r in results):
        raise SystemExit(f"{backend}: a request did not load all {args.blocks} blocks")
    timings = report.workers["decode"][0]["timings"][1:]  # (post s, posted -> landed s, bytes, blocks)
    return [r.load_latency for r in results[1:]], [t[1] for t in timings], report.bytes_moved // len(results)


def bench_read(backend: str, block: int, batch: int, cold: bool) -> dict:
    """``kvt bench``'s row for one READ of ``batch`` blocks of ``block`` bytes
    (``cold``: with ``--cold``, each iteration's blocks out of cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [str(Path(sys.executable).with_name("kvt")), "bench", "--backend", backend, "--groups", "sweep", "--ops", "READ",
               "--block-sizes", str(block), "--batches", str(batch), "--baselines", "memcpy", "--rounds", "1",
               "--no-progress", "--json", str(out), *(["--cold"] if cold else [])]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        rows = json.loads(out.read_text())["results"]
    mine = [r for r in rows if r.get("engine") == backend and r.get("median_s")]
    memcpy = [r for r in rows if r.get("engine") == "memcpy" and r.get("median_s")]
    if not mine:
        raise SystemExit(f"kvt bench gave no {backend} row: {rows}")
    return {"median_s": mine[0]["median_s"], "memcpy_s": memcpy[0]["median_s"] if memcpy else None}


def integrity_cost(args: argparse.Namespace) -> None:
    """Engine load times with integrity checks off, then on (both engines)."""
    print("| backend | integrity | engine load ms | worker posted -> landed (and proven) ms | on - off ms |")
    print("|---|---|---:|---:|---:|")
    for backend in args.backends.split(","):
        off = None
        for on in ("0", "1"):
            os.environ["KVT_INTEGRITY"] = on  # the engines' workers take kvt's environment
            loads, landed, _ = engine_loads(backend, args)
            load = statistics.median(loads)
            off = load if off is None else off
            print(f"| {backend} | {'on' if on == '1' else 'off'} | {1e3 * load:.2f} | "
                  f"{1e3 * statistics.median(landed):.2f} | {1e3 * (load - off):.2f} |", flush=True)
    os.environ.pop("KVT_INTEGRITY")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="host")
    ap.add_argument("--requests", type=int, default=12, help="timed requests (one more runs first, untimed)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per request")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the engine runs and the benches, alternately, this many times; then the median "
                         "of the rounds' ratios (a VM's speed swings between periods: one round is a draw)")
    ap.add_argument("--integrity", action="store_true",
                    help="instead: the engine's load times with integrity checks off and on (KVT_INTEGRITY)")
    args = ap.parse_args()
    if args.integrity:
        integrity_cost(args)
        return
    part = args.heads * args.block_size * args.head_dim * 2  # one layer's K or V of one block, float16
    descs = args.layers * 2 * args.blocks
    print(f"{args.requests} requests of {args.blocks} blocks ({descs} descriptors of {part // 1024} KiB, "
          f"{descs * part / 2**20:.1f} MiB each), one at a time; medians\n")
    print("| backend | decode worker | engine load ms | worker posted -> landed ms | kvt bench READ ms "
          "| engine / bench | memcpy ms | kvt bench --cold READ ms | engine / cold bench | memcpy cold ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for backend in args.backends.split(","):
        for _ in range(args.rounds):
            runs = {}
            for where, in_process in (("own process", False), ("in-process", True)):
                loads, landed, nbytes = engine_loads(backend, args, in_process)
                if nbytes != descs * part:
                    raise SystemExit(f"{backend}: a request moved {nbytes} bytes, expected {descs * part}")
                runs[where] = statistics.median(loads), statistics.median(landed)
            benches = [bench_read(backend, part, descs, cold) for cold in (False, True)]
            for where, (load, landed) in runs.items():
                cells = []
                for b in benches:
                    memcpy = f"{1e3 * b['memcpy_s']:.2f}" if b["memcpy_s"] else "-"
                    cells += [f"{1e3 * b['median_s']:.2f}", f"{load / b['median_s']:.2f}x", memcpy]
                ratios.setdefault((backend, where), []).append(tuple(load / b["median_s"] for b in benches))
                print(f"| {backend} | {where} | {1e3 * load:.2f} | {1e3 * landed:.2f} | {' | '.join(cells)} |",
                      flush=True)
    if args.rounds > 1:
        print(f"\nOver {args.rounds} rounds (each: the engine runs, then the benches):\n")
        print("| backend | decode worker | engine / bench: median (range) | engine / cold bench: median (range) |")
        print("|---|---|---|---|")
        for (backend, where), rs in ratios.items():
            cells = [f"{statistics.median(x):.2f}x ({min(x):.2f}-{max(x):.2f})" for x in zip(*rs)]
            print(f"| {backend} | {where} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
