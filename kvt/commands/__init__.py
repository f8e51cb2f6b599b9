"""Subcommands of the ``kvt`` CLI, one module each.

A command module exposes ``register(subparsers)``: it adds its parser with
``subparsers.add_parser(...)`` and sets ``func`` (``parser.set_defaults(func=run)``)
to a callable taking the parsed ``argparse.Namespace`` and returning an exit
code (``None`` counts as 0).  A ``KvtError`` escaping ``func`` is printed
without a traceback and exits with code 2 (see ``kvt.cli``).

Commands that run a backend share ``add_config_arguments`` /
``config_from_args`` so that ``--backend``, ``--config`` and ``-o KEY=VALUE``
mean the same everywhere and go through ``kvt.config.load_config``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from ..config import MAX_SECONDS, Config, load_config
from ..errors import ConfigError, InvalidArgument

__all__ = ["add_config_arguments", "config_from_args", "parse_option", "check_seconds", "check_writable",
           "physical_memory", "format_bytes"]


def add_config_arguments(parser: argparse.ArgumentParser, *, backend_metavar: str = "NAME",
                         backend_help: str = "backend to use (see `kvt backends`); default: host") -> None:
    """Add ``--backend``, ``--config`` and repeatable ``-o/--option KEY=VALUE``
    (a command whose ``--backend`` means something else says so in ``backend_help``)."""
    group = parser.add_argument_group("configuration (overrides KVT_BACKEND / KVT_CONFIG)")
    group.add_argument("--backend", metavar=backend_metavar, help=backend_help)
    group.add_argument("--config", metavar="PATH", help="TOML config file (default: $KVT_CONFIG)")
    group.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", default=[], dest="options",
                       help="backend option; VALUE is parsed as JSON when it can be (5, true, \"x\"), "
                            "else taken as a string; repeatable")


def parse_option(text: str) -> tuple[str, Any]:
    """``"timeout=5"`` -> ``("timeout", 5)``; a VALUE that is not JSON stays a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--option expects KEY=VALUE, got {text!r}")
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        value = raw
    return key, value


def config_from_args(args: argparse.Namespace, shared: bool = False, **overrides: Any) -> Config:
    """The ``Config`` for a command parsed with ``add_config_arguments``;
    ``overrides`` are further ``Config`` fields taken from the command's own
    flags.  ``shared``: ``-o`` serves several backends, each ignoring keys it does not read."""
    options = dict(parse_option(o) for o in args.options) or None
    return load_config(args.backend, options, path=args.config, shared=shared,
                       origin="the command line (-o/--option, --backend)", **overrides)


def report_console() -> Any:
    """The rich console a command prints its report on: a terminal's width, or
    for a pipe or a file (unless ``COLUMNS`` is set) lines as long as they
    need, so that a reader such as ``grep`` gets every row whole."""
    from rich.console import Console

    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    return Console(width=1 << 16, soft_wrap=True) if piped else Console()


def check_seconds(value: float | None, flag: str, limit: float = MAX_SECONDS) -> None:
    """``InvalidArgument`` unless ``value`` (when given) is a finite number of seconds in (0, limit]."""
    if value is not None and not (0 < value <= limit and math.isfinite(value)):
        raise InvalidArgument(f"{flag} must be a positive number of seconds, at most {limit:g}; got {value!r}")


def check_writable(path: str | None, flag: str) -> None:
    """``InvalidArgument`` unless ``path`` (when given) is a file this process can write: checked before
    any work, so that an hour's measurement is not lost to a typo in an output path.  Creates nothing."""
    if path is None:
        return
    p = Path(path)
    why = None
    if p.is_dir():
        why = "it is a directory"
    elif p.exists():
        if not os.access(p, os.W_OK):
            why = "permission denied"
    else:
        try:  # the parent must exist and take a new file (a read-only mount says so only when tried)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            why = e.strerror or str(e)
        else:
            os.close(fd)
            p.unlink()
    if why:
        raise InvalidArgument(f"cannot write {flag} {path}: {why}; give a writable file path")


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 where unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def format_bytes(n: float) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
