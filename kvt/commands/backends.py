"""``kvt backends``: what is installed here, what it can do, whether it runs.

Each installed backend is imported (unlike ``registry.list_backends``) to
read its declared capabilities and ask ``availability()``; one that fails to
import shows as unusable with the reason, it does not stop the listing.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec
from rich import box
from rich.table import Table
from rich.text import Text

from .. import agent, memcopy, memory, registry
from ..config import load_config
from ..errors import BackendLoadError, ConfigError
from ..types import Availability, Capabilities, MemKind, Op
from . import check_seconds, report_console

__all__ = ["register", "run", "statuses", "as_json"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("backends", help="list installed backends, their capabilities and usability",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="only these backends (an unknown or uninstalled name is an error)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--timeout", type=float, default=registry.PROBE_TIMEOUT, metavar="SECONDS",
                   help="give up on a plugin that has not imported and answered availability() within this "
                        f"(it is listed as not usable); default {registry.PROBE_TIMEOUT:g}")
    p.set_defaults(func=run)


def statuses(names: list[str] | None = None, timeout: float = registry.PROBE_TIMEOUT) -> list[registry.BackendStatus]:
    """Status of ``names`` (raising for unknown ones), else of every installed backend."""
    if names:
        return [registry.probe(n, timeout) for n in dict.fromkeys(names)]
    out = []
    for info in registry.list_backends():
        try:
            out.append(registry.probe(info.name, timeout))
        except BackendLoadError as e:  # e.g. one name declared by two distributions
            out.append(registry.BackendStatus(info, None, Availability(False, str(e))))
    return out


def _kinds(caps: Capabilities) -> list[str]:
    return [k.value for k in MemKind if k in caps.mem_kinds]


def _ops(caps: Capabilities) -> list[str]:
    return [o.value for o in Op if o in caps.ops]


def _peers(caps: Capabilities) -> list[str]:
    return [p for p, on in (("local", caps.local), ("remote", caps.remote), ("cross-host", caps.cross_host)) if on]


def as_json(status: registry.BackendStatus) -> dict[str, Any]:
    """One backend as plain data; these keys are stable."""
    caps = status.capabilities
    return {
        "name": status.info.name,
        "entry_point": status.info.value,
        "distribution": status.info.dist,
        "version": status.info.version,
        # every Capabilities field, the two sets as lists in enum order
        "capabilities": None if caps is None else {
            **msgspec.to_builtins(caps), "mem_kinds": _kinds(caps), "ops": _ops(caps)},
        "usable": status.usable,
        "reason": status.availability.reason,
        # the option keys it reads (-o KEY=VALUE); null: not declared, or not loaded
        "options": None if status.options is None else sorted(status.options),
        # "native (why)" / "python (why)" for a backend with a compiled post path and its twin, else null
        "post_path": status.post_path,
    }


def _cells(s: registry.BackendStatus) -> list[str]:
    caps = s.capabilities
    declared = ["-"] * 5 if caps is None else [
        " ".join(_kinds(caps)), " ".join(_ops(caps)), "yes" if caps.notifications else "no",
        ", ".join(_peers(caps)), caps.owner_check or "-"]
    return [s.info.name, "yes" if s.usable else "no", f"{s.info.dist} {s.info.version}", *declared]


def _table(rows: list[registry.BackendStatus]) -> Table:
    cells = [_cells(s) for s in rows]
    table = Table(title="kvt backends", box=box.SIMPLE_HEAD)
    for i, col in enumerate(("name", "usable", "distribution", "memory", "ops", "notif", "peers", "owner check")):
        # a narrow terminal wraps the descriptive cells; name and verdict stay whole
        table.add_column(col, no_wrap=i < 2, overflow="fold", min_width=len(col))
    for row in cells:
        # Text cells: shown verbatim, never parsed as rich markup
        styles = ["bold", "green" if row[1] == "yes" else "red"] + [""] * 6
        table.add_row(*(Text(c, style=st) for c, st in zip(row, styles)))
    return table


def _print_table(rows: list[registry.BackendStatus], show_missing: bool) -> None:
    console = report_console()
    console.print(_table(rows))
    reasons = dict.fromkeys((s.info.name, s.availability.reason) for s in rows if not s.usable)
    for name, reason in reasons:
        console.print(Text.assemble((name, "bold"), " is not usable: ", (reason, "red")))
    kind, why = memory.page_policy()
    console.print(Text.assemble(("copy engine: ", "bold"), f"{memcopy.ENGINE} ({memcopy.ENGINE_REASON}); "
                                f"{memcopy.THREADS} threads per large request, {memcopy.BACKGROUND_THREADS} "
                                f"off the posting thread; non-temporal stores: {memcopy.STREAMING}"))
    paths = [f"Agent {agent.POST_PATH} ({agent.POST_PATH_REASON})", *(f"{s.info.name} {s.post_path}" for s in rows
                                                                       if s.post_path)]
    console.print(Text.assemble(("post path: ", "bold"), "; ".join(paths)))
    console.print(Text.assemble(("shared segments: ", "bold"), f"{kind} pages ({why})"))
    console.print(Text.assemble(("configured: ", "bold"), _configured(rows)))
    installed = {s.info.name for s in rows}
    missing = [f"{n} ({d})" for n, d in registry.KNOWN.items() if n not in installed]
    if show_missing and missing:
        console.print(Text(f"Not installed: {', '.join(missing)}; install with "
                           f"`{registry.install_hint('NAME')}` from a kvt checkout.", style="dim"))


def _configured(rows: list[registry.BackendStatus]) -> str:
    """Which backend an agent started here would use, and why (KVT_BACKEND, KVT_CONFIG, the default)."""
    try:
        config = load_config()
    except ConfigError as e:
        return f"none: {e}"
    usable = {s.info.name: s.usable for s in rows}
    if config.backend in usable:
        verdict = "" if usable[config.backend] else ", not usable here"
    else:
        installed = config.backend in {i.name for i in registry.list_backends()}
        verdict = ", not listed above" if installed else ", not installed"
    return (f"{config.backend} ({config.backend_source}{verdict}); choose another with KVT_BACKEND=NAME, "
            "backend = \"NAME\" in the KVT_CONFIG file, or --backend")


def run(args: argparse.Namespace) -> int:
    check_seconds(args.timeout, "--timeout")
    rows = statuses(args.names, args.timeout)
    if args.json:
        print(json.dumps([as_json(s) for s in rows], indent=2))
    else:
        _print_table(rows, show_missing=not args.names)
    return 0
