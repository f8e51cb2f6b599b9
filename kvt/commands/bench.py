"""``kvt bench``: bandwidth and latency of every backend, side by side with a
memcpy of the same blocks and with the same transfers written directly
against NIXL's ``nixl_agent``.

Each backend (and raw NIXL) runs an initiator and a target in two fresh
processes, like a decode and a prefill worker.  ``--backend`` takes a
comma-separated list (default: every installed backend; those not usable
here are skipped with the reason); ``-o`` options apply to each of them.
See docs/performance.md for what every figure means.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from .. import registry
from ..errors import BackendNotFound, InvalidArgument, KvtError
from . import (add_config_arguments, check_seconds, check_writable, config_from_args, format_bytes, physical_memory,
               report_console)

__all__ = ["register", "run", "engine_specs"]

_BASELINES = ("memcpy", "raw-nixl")
MAX_ROUNDS = 100  #: each round runs every engine over the whole plan again


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="bandwidth/latency sweep of the backends vs memcpy and raw NIXL",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small sweep that finishes in a minute or two")
    p.add_argument("--baselines", default=",".join(_BASELINES), metavar="LIST",
                   help="baselines to run: memcpy, raw-nixl (where nixl is installed), or none; default: both")
    p.add_argument("--ops", default="read,write", metavar="LIST", help="READ and/or WRITE (default: both)")
    p.add_argument("--groups", default="sweep,inflight,scale", metavar="LIST",
                   help="sweep (block size x batch), inflight (1/8/64 requests at once), "
                        "scale (1,000 -> 100,000 blocks per transfer); default: all")
    sweep = p.add_argument_group("the cases (defaults depend on --quick)")
    sweep.add_argument("--block-sizes", metavar="LIST", help="e.g. 4K,64K,1M,16M,64M")
    sweep.add_argument("--batches", metavar="LIST", help="blocks per request, e.g. 1,8,64,512,4096")
    sweep.add_argument("--max-bytes", metavar="SIZE", help="skip sweep cases moving more per request (256M)")
    sweep.add_argument("--inflight", metavar="LIST", help="requests in flight at once (1,8,64)")
    sweep.add_argument("--scale", metavar="LIST", help="blocks per transfer of the scaling rows (1000,10000,100000)")
    timing = p.add_argument_group("timing")
    timing.add_argument("--budget", type=float, metavar="S", help="seconds of timed iterations per case")
    timing.add_argument("--warmup", type=int, metavar="N", help="untimed iterations per case")
    timing.add_argument("--min-iters", type=int, metavar="N", help="timed iterations per case at least")
    timing.add_argument("--timeout", type=float, metavar="S", help="seconds one iteration may take (60)")
    rotation = timing.add_mutually_exclusive_group()
    rotation.add_argument("--rotate", metavar="SIZE",
                          help="cycle each case's iterations over disjoint blocks, SIZE per side "
                               "(default 1M: warm, yet no row rests on one block's place in the cache; "
                               "0: the same blocks every iteration)")
    rotation.add_argument("--cold", nargs="?", const="auto", metavar="SIZE",
                          help="rotate over more than the CPU cache (default: twice its size), so requests "
                               "are timed from memory as an engine's KV is, not from cache")
    timing.add_argument("--rounds", type=int, metavar="N",
                        help="run every engine N times, alternating their order, and pool the iterations "
                             f"(default: 2; 1 with --quick; at most {MAX_ROUNDS})")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write every row and the run's settings as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="plot bandwidth vs block size per backend")
    out.add_argument("--markdown", metavar="FILE", help="write the tables as GitHub markdown (for docs)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(p, backend_metavar="LIST",
                         backend_help="backends to measure, e.g. host,nixl,ucx (default: every installed one)")
    p.set_defaults(func=run)


def _list(text: str | None, convert=str, flag: str = "") -> list | None:
    if text is None:
        return None
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            out.append(convert(x))
        except InvalidArgument as e:  # parse_size says what a size is
            raise InvalidArgument(f"{flag}: {e}") from None
        except ValueError:
            raise InvalidArgument(f"{flag}: {x!r} in {text!r} is not a whole number; give a comma-separated "
                                  "list such as 1,8,64") from None
    return out


def _size(text: str | None, flag: str) -> int | None:
    from ..bench import parse_size

    try:
        return None if text is None else parse_size(text)
    except InvalidArgument as e:
        raise InvalidArgument(f"{flag}: {e}") from None


def _plan(args: argparse.Namespace):
    from ..bench import make_plan, parse_size
    from ..bench.plan import cold_default

    sizes = _list(args.block_sizes, parse_size, "--block-sizes")
    max_bytes = _size(args.max_bytes or None, "--max-bytes")
    if args.cold is not None:
        rotate = cold_default() if args.cold == "auto" else _size(args.cold, "--cold")
    else:
        rotate = None if args.rotate is None else 0 if args.rotate.strip() == "0" else _size(args.rotate, "--rotate")
    check_seconds(args.budget, "--budget")
    check_seconds(args.timeout, "--timeout")
    plan = make_plan(args.quick, groups=_list(args.groups), ops=_list(args.ops), blocks=sizes,
                     batches=_list(args.batches, int, "--batches"), max_bytes=max_bytes,
                     inflight=_list(args.inflight, int, "--inflight"), scale=_list(args.scale, int, "--scale"),
                     budget=args.budget, warmup=args.warmup, min_iters=args.min_iters, timeout=args.timeout,
                     rotate=rotate)
    _check_memory(plan)
    return plan


def _check_memory(plan) -> None:
    """Refuse a plan whose buffers cannot fit: each engine's two sides each hold ``plan.arena``
    bytes, pre-faulted, on this host (memcpy: both in one process)."""
    from ..bench import format_size

    need, have = 2 * plan.arena, physical_memory()
    if have and need > have:
        big = max(plan.cases, key=lambda c: c.nbytes * plan.rotations(c))
        raise InvalidArgument(
            f"the plan needs {format_bytes(need)} of memory (two buffers of {format_bytes(plan.arena)}, for its "
            f"largest case: {big.group} {format_size(big.block)} x {big.batch} x {big.inflight}"
            f"{f', rotated over {format_size(plan.rotate)}' if plan.rotations(big) > 1 else ''}), more than this "
            f"machine's {format_bytes(have)}; lower --block-sizes, --batches, --max-bytes, --inflight, --scale "
            "or --rotate/--cold")


def _config(args: argparse.Namespace, backend: str, shared: bool = True):
    """The configuration ``--config`` / ``-o`` give ``backend``; ``shared``: ``-o``
    serves several engines, so ``backend`` ignores keys it does not read."""
    return config_from_args(argparse.Namespace(**{**vars(args), "backend": backend}), shared=shared)


def engine_specs(args: argparse.Namespace) -> list:
    """Baselines first, then the backends, as ``EngineSpec``s.  Imports no plugin:
    whether a backend is usable is learnt in its own processes."""
    from ..bench import MEMCPY, RAW_NIXL, EngineSpec

    baselines = [] if args.baselines.strip() == "none" else _list(args.baselines)
    bad = [b for b in baselines if b not in _BASELINES]
    if bad:
        raise InvalidArgument(f"unknown baseline(s) {bad}; choose from {list(_BASELINES)} or none")
    specs = []
    if MEMCPY in baselines:
        specs.append(EngineSpec(MEMCPY, "memcpy"))
    installed = [b.name for b in registry.list_backends()]
    if RAW_NIXL in baselines and importlib.util.find_spec("nixl") is not None:
        # the nixl backend's configuration (progress_thread, ucx_env) applies to raw NIXL too
        specs.append(EngineSpec(RAW_NIXL, "raw-nixl", _config(args, "nixl"), required=False))
    names = list(dict.fromkeys(_list(args.backend))) if args.backend else installed  # each backend once
    for name in names:
        if name not in installed:
            raise BackendNotFound(f"no installed kvt backend {name!r} (installed: {', '.join(installed) or 'none'}); "
                                  "see `kvt backends`")
        # one backend named: a key it does not read is a typo (refused); several: each ignores the others'
        specs.append(EngineSpec(name, "kvt", _config(args, name, shared=len(names) > 1), required=bool(args.backend)))
    if not specs:
        raise InvalidArgument("nothing to run: no backend installed and no baseline selected")
    return specs


def _run_all(specs: list, plan, rounds: int, show_progress: bool) -> list:
    """Every engine, ``rounds`` times; one combined ``Outcome`` per engine.

    Rounds alternate the engine order (A B C, C B A, ...): on a machine whose
    load drifts during the run, a steady drift then weighs on every engine
    alike.  An engine that failed or was skipped once is not run again."""
    from ..bench import Outcome, format_size, run_engine

    results: dict[str, list] = {s.name: [] for s in specs}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), disable=not show_progress, transient=True)
    with progress:
        task = progress.add_task("starting", total=len(plan.cases) * len(specs) * rounds)
        for rnd in range(rounds):
            for spec in specs if rnd % 2 == 0 else specs[::-1]:
                if any(o.status != "ok" for o in results[spec.name]):
                    progress.update(task, advance=len(plan.cases))
                    continue
                progress.update(task, description=f"{spec.name}: starting processes")

                def on_row(row: dict, spec=spec) -> None:
                    progress.update(task, advance=1, description=f"{spec.name}: {row['group']} {row['op']} "
                                    f"{format_size(row['block'])} x {row['batch']} x {row['inflight']}")

                outcome = run_engine(spec, plan, on_row)
                progress.update(task, advance=len(plan.cases) - len(outcome.rows))
                results[spec.name].append(outcome)
    combined = []
    for spec in specs:
        outs = results[spec.name]
        bad = next((o for o in outs if o.status != "ok"), None)
        combined.append(Outcome(spec, bad.status if bad else "ok", bad.reason if bad else "",
                                [r for o in outs for r in o.rows]))
    return combined


def _check_plot_format(path: str) -> None:
    """``InvalidArgument`` for a ``--plot`` file whose extension matplotlib
    cannot write (it would tell only after the whole sweep).  No extension:
    matplotlib's default format."""
    from pathlib import Path

    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix[1:].lower()  # as matplotlib's savefig reads it
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise InvalidArgument(f"--plot {path}: matplotlib cannot write .{suffix} files; name the file with one "
                              f"of {', '.join('.' + f for f in sorted(formats))}")


def run(args: argparse.Namespace) -> int:
    from ..bench import add_ratios, check_configs, format_size, merge_rounds, report

    plan = _plan(args)
    specs = engine_specs(args)
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 2
    if not 1 <= rounds <= MAX_ROUNDS:
        raise InvalidArgument(f"--rounds must be in 1..{MAX_ROUNDS} (each round runs every engine over the "
                              f"whole plan again), got {rounds}")
    for flag in ("json", "markdown", "plot"):  # before the run, not after it
        check_writable(getattr(args, flag), f"--{flag}")
    if args.plot and "sweep" not in plan.meta["groups"]:
        raise InvalidArgument("--plot draws the sweep group; add sweep to --groups")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the run, not after it
        raise InvalidArgument("--plot needs matplotlib, which is not installed; install it with "
                              "`pip install 'kvt[bench]'` (or `pip install matplotlib`), or drop --plot")
    if args.plot:
        _check_plot_format(args.plot)
    check_configs(specs)  # a refused option now, not after the engines before it ran
    before, started = report.machine(), time.time()
    Console(stderr=True).print(
        f"kvt bench: {len(plan.cases)} cases x {len(specs)} engines ({', '.join(s.name for s in specs)}) "
        f"x {rounds} round(s); {before['cpus']} CPUs, load average {before['loadavg'][0]:.2f}",
        style="dim", highlight=False)
    outcomes = _run_all(specs, plan, rounds, not args.no_progress)
    engines = [o.spec.name for o in outcomes if o.rows]  # skipped and failed engines get no column
    rows = report.ordered(add_ratios(merge_rounds(r for o in outcomes for r in o.rows)), plan, engines)
    console = report_console()  # a pipe or file gets the whole table, not one squeezed to 80 columns
    how = "cold" if args.cold is not None else "rotating"
    blocks = f", {how} over {format_size(plan.rotate)}" if plan.rotate else ", the same blocks every iteration"
    console.print(report.table(rows, title=f"kvt bench ({'quick' if args.quick else 'full'} sweep, "
                                            f"{rounds} round{'s' if rounds > 1 else ''}{blocks})"))
    growth = report.growth_table(rows)
    if growth is not None:
        console.print(growth)
    for o in outcomes:
        if o.status != "ok":
            console.print(Text.assemble((o.spec.name, "bold"), f" {o.status}: ",
                                        (o.reason, "red" if o.status == "error" else "yellow")))
    for r in rows:
        if r["error"]:
            console.print(Text(f"{r['engine']} {r['group']} {r['op']} {r['block']} B x {r['batch']} "
                               f"x {r['inflight']}: {r['error']}", style="red"))
    after = report.machine()
    console.print(Text(f"{before['cpus']} CPUs; load average {before['loadavg'][0]:.2f} before, "
                       f"{after['loadavg'][0]:.2f} after; GB/s = bytes per iteration / median latency", style="dim"))
    try:  # checked writable before the run; a disk can still fill up or a directory vanish since
        if args.json:
            options = {k: v for k, v in vars(args).items() if k != "func"}
            report.write_json(args.json, report.document(plan, outcomes, rows, argv=sys.argv, options=options,
                                                         rounds=rounds, started=started, finished=time.time(),
                                                         machine_before=before))
        if args.markdown:
            report.write_text(args.markdown, report.markdown(rows, engines))
        if args.plot:
            try:
                report.plot(rows, args.plot, engines)
            except ValueError as e:  # matplotlib's (a format it has, but cannot write here): one line
                raise InvalidArgument(f"--plot {args.plot}: matplotlib could not write it: {e}") from None
    except OSError as e:
        raise KvtError(f"could not write the results to {e.filename or 'a file'}: {e.strerror or e}") from e
    failed = any(o.status == "error" for o in outcomes) or any(r["error"] for r in rows)
    return 1 if failed else 0
