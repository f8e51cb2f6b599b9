"""The ``kvt`` command line: ``kvt backends``, ``kvt demo``, ``kvt bench``,
``kvt conformance``, ``kvt new-backend``, ``kvt --version``.

Each subcommand lives in ``kvt.commands.<name>`` (see ``kvt.commands``).  A
``KvtError`` escaping a command prints ``kvt: error: ...`` on stderr and exits
with code 2; any other exception is a bug and keeps its traceback.  Standard
output that cannot be written is not a bug: a full disk or a broken device
prints ``kvt: error: cannot write to standard output: ...`` and exits 1; a
reader that went away (``kvt backends | head -c1``) ends the command quietly
(exit code 1), as Unix tools stop on SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Sequence

from . import __version__
from .errors import KvtError
from .logs import log_to_stderr

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


class _Parser(argparse.ArgumentParser):
    def _print_message(self, message, file=None):
        # argparse ignores write errors (``kvt --help > /dev/full`` would exit 0): let main() see them
        if message:
            (file or sys.stderr).write(message)


class _Stdout:
    """``sys.stdout`` that remembers a failed write, so that ``main`` tells
    an unwritable stdout from any other ``OSError`` (a bug, or a child's pipe)."""

    def __init__(self, stream):
        self._stream, self.error = stream, None

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvt", description="Move KV-cache blocks between processes through pluggable backends.")
    parser.add_argument("--version", action="version", version=f"kvt {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for mod in _command_modules():
        mod.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (``sys.exit(main())``)."""
    real = sys.stdout
    out = sys.stdout = _Stdout(real)
    try:
        code = _main(argv)
        sys.stdout.flush()  # a write error shows here, not as a traceback at interpreter exit
        return code
    except OSError as e:
        if out.error is None:
            raise
        try:  # what is still buffered would fail again at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), real.fileno())
        except (OSError, ValueError):
            pass
        if not isinstance(e, BrokenPipeError):  # the reader went away: nothing to say, as Unix tools
            print(f"kvt: error: cannot write to standard output: {e.strerror or e}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = real


def _main(argv: Sequence[str] | None) -> int:
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
        log_to_stderr()
        return int(func(args) or 0)
    except KvtError as e:
        print(f"kvt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
