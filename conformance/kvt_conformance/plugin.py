"""The pytest plugin (entry point ``pytest11``): command-line options, the
report header, and the JSON report.

It is inert unless asked for: without ``--kvt-backend`` or ``--kvt-report``
it only registers its options and the ``kvt_requires`` marker, and loading
it imports neither kvt nor any backend.  With plugin autoloading off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``) load it with ``-p kvt_conformance.plugin``.

* ``--kvt-backend=NAME``   test backend NAME (an installed ``kvt.backends``
  entry point) with ``pytest --pyargs kvt_conformance``; the header names
  the backend, its version and its declared capabilities.
* ``--kvt-options=JSON``   options for every backend instance, e.g.
  ``'{"timeout": 5}'`` (over the suite's default ``{"timeout": 10}``).
* ``--kvt-report=FILE``    write results per test and per capability area
  as JSON (what ``kvt conformance`` reads to print its table).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

#: config.stash keys: every Target a run tested (for reports); the parsed
#: --kvt-options; the --kvt-backend target
TARGETS_KEY = pytest.StashKey[dict]()
OPTIONS_KEY = pytest.StashKey[dict]()
CLI_TARGET_KEY = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvt", "kvt backend conformance")
    group.addoption("--kvt-backend", metavar="NAME", default=None,
                    help="backend to test (installed kvt.backends entry point); "
                         "use with `pytest --pyargs kvt_conformance`")
    group.addoption("--kvt-options", metavar="JSON", default=None,
                    help="JSON object of options for every backend instance, e.g. '{\"timeout\": 5}'")
    group.addoption("--kvt-report", metavar="FILE", default=None,
                    help="write kvt conformance results (per test and per capability area) as JSON")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kvt_requires(*needs): capabilities a kvt conformance test needs "
                   "(local, remote, cross_host, notifications, READ, WRITE, DRAM, VRAM, DEVICE)")
    raw = config.getoption("kvt_options")
    if raw:
        try:
            options = json.loads(raw)
        except json.JSONDecodeError as e:
            raise pytest.UsageError(f"--kvt-options must be a JSON object, e.g. '{{\"timeout\": 5}}': {e}") from None
        if not isinstance(options, dict):
            raise pytest.UsageError(f"--kvt-options must be a JSON object, got {type(options).__name__}")
        config.stash[OPTIONS_KEY] = options
    name = config.getoption("kvt_backend")
    if name:
        config.stash[CLI_TARGET_KEY] = _resolve(name, config.stash.get(OPTIONS_KEY, {}))
    report = config.getoption("kvt_report")
    if report:
        from .report import Recorder

        config.pluginmanager.register(Recorder(config, Path(report)), "kvt-conformance-report")


def _resolve(name: str, options: dict):
    from kvt.errors import KvtError

    from .target import Target

    try:
        target = Target.resolve(name, options)
    except KvtError as e:
        raise pytest.UsageError(f"--kvt-backend={name}: {e}") from None
    avail = target.availability()
    if not avail.usable:
        raise pytest.UsageError(f"--kvt-backend={name}: backend cannot run on this machine: {avail.reason}")
    return target


def pytest_report_header(config: pytest.Config) -> list[str]:
    target = config.stash.get(CLI_TARGET_KEY, None)
    return [target.header()] if target is not None else []


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    targets = config.stash.get(TARGETS_KEY, {})
    if targets and config.stash.get(CLI_TARGET_KEY, None) is None:  # subclass mode: say what was tested
        terminalreporter.section("kvt conformance")
        for target in targets.values():
            terminalreporter.write_line(target.header())


def pytest_unconfigure(config: pytest.Config) -> None:
    peer = sys.modules.get("kvt_conformance.peer")
    if peer is not None:  # only if some suite ran: stop the shared peer processes
        peer.close_shared_pool()
