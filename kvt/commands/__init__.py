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
from typing import Any

import msgspec

from ..config import Config, load_config
from ..errors import ConfigError

__all__ = ["add_config_arguments", "config_from_args", "parse_option"]


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


def config_from_args(args: argparse.Namespace, **overrides: Any) -> Config:
    """The ``Config`` for a command parsed with ``add_config_arguments``;
    ``overrides`` are further ``Config`` fields taken from the command's own flags."""
    options = dict(parse_option(o) for o in args.options) or None
    return load_config(args.backend, options, path=args.config, **overrides)
