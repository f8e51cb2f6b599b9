"""The ucx backend next to the nixl backend, raw NIXL and memcpy, same run.

    python benchmarks/bench_ucx.py [--budget 2] [--ucx-option error_handling=peer ...]

Rows: 1 x 256 MiB, 4096 x 64 KiB and 4096 x 4 KiB, READ and WRITE.  Every
engine runs an initiator and a target in two fresh processes (kvt backends
through ``kvt.Agent``, as an engine would drive them); nixl and ucx never
share a process (each bundles its own libucx).  The target's block ids are a
random permutation, so no engine can merge neighbouring blocks.  memcpy copies
the same blocks inside one process: the ceiling.  ``cma`` (the host backend
with ``transport="cma"``) is Linux cross-memory attach driven directly: the
single-copy path UCX's RMA takes between two processes on one host (the ucx
backend's gets and puts are cma copies there), so the practical ceiling for
any UCX-based backend here.

Prints a markdown table (median of the timed iterations; ratios to memcpy and
to the kvt nixl backend) and the command line that produced it.  Targets:
ucx >= 0.8 x memcpy on 256 MiB, ucx >= nixl on every row.  The machinery is
``kvt.bench``; this script only picks the cases and the columns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvt.bench import MEMCPY, RAW_NIXL, Case, EngineSpec, Plan, add_ratios, format_size, run_engine
from kvt.bench.report import machine
from kvt.config import load_config
from kvt.types import Op

SHAPES = [(256 << 20, 1), (64 << 10, 4096), (4 << 10, 4096)]
CMA = "cma"  # the host backend forced onto process_vm_readv/writev: a reference, not a competitor


def _options(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        key, _, value = p.partition("=")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed iterations per case")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--ucx-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the ucx backend (VALUE parsed as JSON when it can be)")
    ap.add_argument("--no-nixl", action="store_true", help="skip the nixl rows")
    ap.add_argument("--no-cma", action="store_true", help="skip the cross-memory-attach reference column")
    args = ap.parse_args()

    cases = tuple(Case("sweep", op, block, batch) for block, batch in SHAPES for op in (Op.READ, Op.WRITE))
    plan = Plan(cases=cases, budget=args.budget, warmup=args.warmup, min_iters=args.min_iters,
                meta={"script": "bench_ucx"})
    specs = [EngineSpec(MEMCPY, "memcpy")]
    if not args.no_nixl:
        specs += [EngineSpec(RAW_NIXL, "raw-nixl", required=False),
                  EngineSpec("nixl", "kvt", load_config(backend="nixl"), required=False)]
    if not args.no_cma:  # the kernel's single-copy path that UCX uses between processes on one host
        specs.append(EngineSpec(CMA, "kvt", load_config(backend="host", options={"transport": "cma"}), required=False))
    specs.append(EngineSpec("ucx", "kvt", load_config(backend="ucx", options=_options(args.ucx_option))))

    before = machine()
    rows, problems = [], []
    for spec in specs:
        print(f"running {spec.name} ...", file=sys.stderr, flush=True)
        out = run_engine(spec, plan)
        rows += out.rows
        if out.status != "ok":
            problems.append(f"{spec.name}: {out.status}: {out.reason}")
    rows = add_ratios(rows)
    after = machine()

    by = {(r["engine"], r["op"], r["block"], r["batch"]): r for r in rows}
    engines = [s.name for s in specs if any(r["engine"] == s.name for r in rows)]

    def gbps(engine, c):
        r = by.get((engine, c.op.value, c.block, c.batch))
        return None if r is None or r["error"] else r["gbps"]

    head = ["op", "blocks"] + [f"{e} GB/s" for e in engines] + ["ucx / memcpy", "ucx / nixl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    verdicts = []
    for c in cases:
        u, m, n = gbps("ucx", c), gbps(MEMCPY, c), gbps("nixl", c)
        xm = f"{u / m:.2f}" if u and m else "-"
        xn = f"{u / n:.2f}" if u and n else "-"
        cells = [c.op.value, f"{c.batch} x {format_size(c.block)}"]
        cells += [f"{gbps(e, c):.2f}" if gbps(e, c) else "failed" for e in engines] + [xm, xn]
        lines.append("| " + " | ".join(cells) + " |")
        if c.batch == 1 and u and m:
            verdicts.append(f"{c.op.value} 256M: ucx {u / m:.2f} x memcpy (target 0.8) "
                            f"{'met' if u >= 0.8 * m else 'NOT met'}")
        if u and n:
            verdicts.append(f"{c.op.value} {c.batch} x {format_size(c.block)}: ucx {u / n:.2f} x nixl (target 1.0) "
                            f"{'met' if u >= n else 'NOT met'}")
    print("\n".join(lines))
    print()
    print(f"Command: `python {' '.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}`; "
          f"{before['cpus']} CPUs, load average {before['loadavg'][0]:.2f} before, {after['loadavg'][0]:.2f} after; "
          "GB/s = bytes per iteration / median latency.")
    for v in verdicts:
        print(f"- {v}")
    for p in problems:
        print(f"- {p}")
    for r in rows:
        if r["error"]:
            print(f"- {r['engine']} {r['op']} {r['batch']} x {r['block']}: {r['error']}")
    return 1 if problems or any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
