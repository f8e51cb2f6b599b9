"""The JSON report (``--kvt-report=FILE``): every test's outcome, its
capability area and, for a skip, its reason; the backends tested.

Schema (stable; ``kvt conformance`` reads it)::

    {"backends": [{"backend", "spec", "distribution", "version", "options", "capabilities"}],
     "areas": {AREA: {"passed": n, "failed": n, "skipped": n}},   # in suite order
     "tests": [{"nodeid", "area", "outcome", "reason", "duration"}],
     "exitstatus": n}

``outcome`` is passed, failed, error (setup/teardown), skipped, xfailed or
xpassed; error counts as failed in ``areas``, xfailed as skipped, xpassed
as passed.  ``reason`` is the skip reason or the failure's first line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .plugin import CLI_TARGET_KEY, TARGETS_KEY

__all__ = ["Recorder", "area_of", "COLUMN"]

#: outcome -> table column
COLUMN = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "failed",
          "skipped": "skipped", "xfailed": "skipped"}


def area_of(item: pytest.Item) -> str:
    """The ``area`` of the suite class that defines the test (so a plugin's
    subclass overriding a test keeps its area)."""
    cls = getattr(item, "cls", None)
    name = getattr(item, "originalname", item.name)
    for klass in getattr(cls, "__mro__", ()):
        if name in vars(klass) and "area" in vars(klass):
            return vars(klass)["area"]
    return getattr(cls, "area", "other")


def _reason(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    if hasattr(report, "wasxfail"):
        return report.wasxfail
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return text.strip().splitlines()[0] if text.strip() else ""


class Recorder:
    def __init__(self, config: pytest.Config, path: Path):
        self.config, self.path = config, path
        self.areas: dict[str, str] = {}
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.areas[item.nodeid] = area_of(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(report.nodeid, {
            "nodeid": report.nodeid, "area": self.areas.get(report.nodeid, "other"),
            "outcome": "passed", "reason": "", "duration": 0.0})
        entry["duration"] += report.duration
        if entry["outcome"] not in ("passed",):  # the first non-pass phase decides
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.skipped:
            outcome = "skipped"
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
        else:
            return
        entry["outcome"], entry["reason"] = outcome, _reason(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from .suites import AREAS

        areas = {a: {"passed": 0, "failed": 0, "skipped": 0} for a in AREAS}
        for t in self.tests.values():
            areas.setdefault(t["area"], {"passed": 0, "failed": 0, "skipped": 0})[COLUMN[t["outcome"]]] += 1
        targets = list(self.config.stash.get(TARGETS_KEY, {}).values())
        cli = self.config.stash.get(CLI_TARGET_KEY, None)
        if cli is not None and not targets:
            targets.append(cli)
        data = {"backends": [t.describe() for t in targets], "areas": areas,
                "tests": list(self.tests.values()), "exitstatus": int(exitstatus)}
        self.path.write_text(json.dumps(data, indent=1, default=str))
