"""The ``kvt`` command line: ``kvt backends``, ``kvt demo``, ``kvt bench``,
``kvt conformance``, ``kvt new-backend``, ``kvt --version``.

Each subcommand lives in ``kvt.commands.<name>`` (see ``kvt.commands``).  A
``KvtError`` escaping a command prints ``kvt: error: ...`` on stderr and exits
with code 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Sequence

from . import __version__
from .errors import KvtError

__all__ = ["main", "build_parser", "COMMANDS"]

#: subcommand modules under kvt.commands, in help order
COMMANDS = ["backends", "demo", "bench", "conformance", "new_backend"]


def _command_modules() -> list[ModuleType]:
    mods = []
    for name in COMMANDS:
        modname = f"{__package__}.commands.{name}"
        try:
            mods.append(importlib.import_module(modname))
        except ModuleNotFoundError as e:
            if e.name != modname:  # the command exists but one of its imports is missing
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvt", description="Move KV-cache blocks between processes through pluggable backends.")
    parser.add_argument("--version", action="version", version=f"kvt {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for mod in _command_modules():
        mod.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (``sys.exit(main())``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse already printed
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except KvtError as e:
        print(f"kvt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
