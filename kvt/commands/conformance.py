"""``kvt conformance NAME``: run the conformance suite against an installed
backend and print a table, capability area x passed / failed / skipped.

It runs ``pytest --pyargs kvt_conformance --kvt-backend=NAME`` in a
subprocess (the suite is the separate ``kvt-conformance`` distribution) and
reads the plugin's JSON report.  ``--junit-xml FILE`` and ``--json FILE``
keep the reports.  Exit code 0 when nothing failed, 1 otherwise, and 1
when no test ran at all (``-k`` matched nothing).

Every backend instance gets the option ``timeout=10`` (seconds: how long a
dead peer may leave a transfer PROC) unless ``-o timeout=S`` says otherwise;
tests wait that plus 5 s for anything to settle.  ``--timeout`` is pytest's
own limit per test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import registry
from ..config import load_config
from ..errors import BackendUnavailable, InvalidArgument, KvtError, KvtTimeoutError
from . import check_seconds, check_writable, parse_option, report_console

#: pytest's exit code when no test was collected (a -k that matched nothing)
_NO_TESTS = 5
#: the longest --timeout: the whole run gets 20 times it, and that must stay a valid wait
_MAX_TIMEOUT = 1e6

__all__ = ["register", "run", "pytest_command", "render"]

_COLUMNS = ("passed", "failed", "skipped")
_STYLE = {"passed": "green", "failed": "red", "skipped": "yellow"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "conformance", help="run the conformance suite against a backend",
        description="Run the conformance suite (pytest --pyargs kvt_conformance) against an installed backend "
                    "and print a table: capability area x passed / failed / skipped. Exit code 0 when "
                    "nothing failed; 1 when a test failed or none ran (-k matched nothing).")
    p.add_argument("name", metavar="NAME", help="backend to test (see `kvt backends`)")
    p.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", default=[], dest="options",
                   help="backend option for every instance; VALUE is parsed as JSON when it can be "
                        "(e.g. -o timeout=5); repeatable")
    p.add_argument("-k", metavar="EXPR", dest="keyword", help="only tests matching this pytest -k expression")
    p.add_argument("--junit-xml", metavar="FILE", help="also write a JUnit XML report")
    p.add_argument("--json", metavar="FILE", help="also write the results (per test and per area) as JSON")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="limit per test (default 300); the whole run gets 20 times that. Not the backend's "
                        "own 'timeout' option, which the suite sets to 10 s unless -o timeout=... says otherwise")
    p.add_argument("-q", "--quiet", action="store_true", help="do not show pytest's own output, only the table")
    p.add_argument("--pytest-args", metavar="ARGS", default="",
                   help="further pytest arguments, one shell-quoted string (e.g. --pytest-args='-x --tb=long')")
    p.set_defaults(func=run)


def pytest_command(name: str, report: Path, options: dict[str, Any], args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvt_conformance", f"--kvt-backend={name}",
           f"--kvt-report={report}", "-p", "no:cacheprovider", f"--timeout={args.timeout:g}",
           "--tb=short", "-q", "-rfE"]
    if options:
        cmd.append(f"--kvt-options={json.dumps(options)}")
    if args.junit_xml:
        cmd.append(f"--junit-xml={Path(args.junit_xml).resolve()}")
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd + shlex.split(args.pytest_args)


def _check_args(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options, once every argument is known to be usable (before pytest starts)."""
    check_seconds(args.timeout, "--timeout", _MAX_TIMEOUT)
    try:
        shlex.split(args.pytest_args)
    except ValueError as e:
        raise InvalidArgument(f"--pytest-args {args.pytest_args!r} is not a shell-quoted string: {e}") from None
    check_writable(args.json, "--json")
    check_writable(args.junit_xml, "--junit-xml")
    options = dict(parse_option(o) for o in args.options)
    load_config(args.name, options, env={})  # the checks every other command applies to -o (e.g. timeout)
    return options


def run(args: argparse.Namespace) -> int:
    options = _check_args(args)
    status = registry.probe(args.name)  # BackendNotFound for an unknown name
    if status.capabilities is None:  # the plugin itself is broken, not the machine
        raise BackendUnavailable(f"backend {args.name!r} failed to load (fix the plugin): "
                                 f"{status.availability.reason}")
    if not status.usable:
        raise BackendUnavailable(f"backend {args.name!r} cannot run on this machine: {status.availability.reason}")
    registry.own_options(args.name, options)  # a key it does not read: ConfigError now, not in every test
    if importlib.util.find_spec("kvt_conformance") is None:
        raise KvtError("the conformance suite is not installed: install the 'kvt-conformance' package "
                       "(`pip install -e conformance` from a kvt checkout)")
    with tempfile.TemporaryDirectory(prefix="kvt-conformance-") as tmp:
        report = Path(args.json).resolve() if args.json else Path(tmp) / "report.json"
        report.unlink(missing_ok=True)
        cmd = pytest_command(args.name, report, options, args)
        out = subprocess.PIPE if args.quiet else None
        # the suite's plugin and pytest-timeout load through their entry points
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
        try:  # cwd: a scratch directory, so no project's conftest or config joins the run
            proc = subprocess.run(cmd, cwd=tmp, stdout=out, stderr=subprocess.STDOUT if out else None,
                                  text=True, timeout=20 * args.timeout, env=env)
        except subprocess.TimeoutExpired as e:
            raise KvtTimeoutError(f"the conformance run did not finish within {20 * args.timeout:g}s") from e
        if not report.exists():
            if args.quiet and proc.stdout:
                print(proc.stdout, file=sys.stderr)
            raise KvtError(f"pytest exited with code {proc.returncode} before writing its report "
                           f"(command: {' '.join(cmd)})")
        data = json.loads(report.read_text())
    render(data, report_console())
    if proc.returncode == _NO_TESTS:
        print(f"kvt conformance: no test ran: nothing matched{f' -k {args.keyword!r}' if args.keyword else ''}; "
              "a run that tests nothing proves nothing, so it fails (see the test names with "
              "--pytest-args=--collect-only)", file=sys.stderr)
        return 1
    failed = sum(a["failed"] for a in data["areas"].values())
    return 0 if failed == 0 and proc.returncode == 0 else 1


def _header(backend: dict[str, Any]) -> Text:
    caps = backend["capabilities"]
    flags = [f for f in ("notifications", "local", "remote", "cross_host") if caps[f]]
    return Text.assemble(
        ("kvt conformance  ", "bold"), (backend["backend"], "bold cyan"),
        f"  {backend['distribution']} {backend['version']}\n",
        f"  declares: memory {' '.join(caps['mem_kinds'])}; ops {' '.join(caps['ops'])}; "
        f"{', '.join(flags) or 'no peers or notifications'}; max_notif_bytes {caps['max_notif_bytes']}; "
        f"owner check {caps.get('owner_check') or '-'}\n",
        *(f"  {what}: {how}\n" for what, how in backend.get("ran", {}).items()),
        f"  options:  {json.dumps(backend['options'])}")


def render(data: dict[str, Any], console: Console) -> None:
    """Print the report: header, the area table, failures, skip reasons."""
    for backend in data["backends"]:
        console.print(_header(backend))
    table = Table(title="capability areas", box=box.SIMPLE_HEAD)
    table.add_column("area", style="bold")
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    table.add_column("verdict")
    totals = Counter()
    for area, counts in data["areas"].items():
        totals.update(counts)
        verdict = ("FAIL", "red") if counts["failed"] else ("pass", "green") if counts["passed"] else ("skipped", "yellow")
        table.add_row(area, *(Text(str(counts[c]), style=_STYLE[c] if counts[c] else "dim") for c in _COLUMNS),
                      Text(*verdict))
    table.add_section()
    table.add_row("total", *(str(totals[c]) for c in _COLUMNS), "")
    console.print(table)
    failures = [t for t in data["tests"] if t["outcome"] in ("failed", "error")]
    for t in failures:
        console.print(Text.assemble(("FAILED ", "red bold"), t["nodeid"], "\n    ", t["reason"]))
    reasons = Counter((t["area"], t["reason"]) for t in data["tests"] if t["outcome"] in ("skipped", "xfailed"))
    if reasons:
        console.print(Text("skipped, by reason:", style="bold"))
        for (area, reason), n in sorted(reasons.items()):
            console.print(Text.assemble(f"  {n:3d}  {area}: ", (reason, "yellow")))
