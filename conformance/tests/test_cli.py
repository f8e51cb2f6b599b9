"""``kvt conformance NAME``: the table, the reports, exit codes, and a
failing backend (a broken double exposed through a test-only entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
KVT = Path(sys.executable).parent / "kvt"  # the console script of the venv running the tests


def run_kvt(*args: str, with_doubles: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("KVT_BACKEND", None)
    if with_doubles:  # broken_backends.py and its dist-info (entry points) become importable
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return subprocess.run([str(KVT), "conformance", *args], capture_output=True, text=True, timeout=600, env=env)


def test_table_and_reports(tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    r = run_kvt("example", "-q", "-k", "TestRegistration or TestMetadata", "-o", "timeout=4",
                "--json", str(report), "--junit-xml", str(junit))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "kvt conformance  example  kvt-example 0.1.0" in out
    assert 'options:  {"timeout": 4}' in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["registration"][:3] == ["8", "0", "4"] and lines["registration"][3] == "pass"
    assert lines["metadata"][1] == "0" and lines["transfers"][:3] == ["0", "0", "0"]
    assert "not declared: ExampleBackend does not declare VRAM memory" in out
    data = json.loads(report.read_text())
    assert data["areas"]["registration"] == {"passed": 8, "failed": 0, "skipped": 4}
    assert data["backends"][0]["options"] == {"timeout": 4}
    assert "<testsuite" in junit.read_text()


def test_failing_backend_exits_1_naming_the_failures(tmp_path):
    r = run_kvt("broken-drops-notifs", "-q", "-k", "test_standalone or test_zero_length_region",
                with_doubles=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED test_conformance.py::TestNotification::test_standalone" in r.stdout
    row = next(line.split() for line in r.stdout.splitlines() if line.strip().startswith("notifications"))
    assert row[1:5] == ["0", "1", "0", "FAIL"]


def test_unknown_backend_exits_2():
    r = run_kvt("no-such-backend")
    assert r.returncode == 2
    assert "kvt: error: no kvt backend named 'no-such-backend'" in r.stderr


def test_extra_pytest_args():
    r = run_kvt("example", "-q", "-k", "test_zero_length_region", "--pytest-args=--collect-only")
    assert r.returncode == 0, r.stdout + r.stderr
    total = next(line.split() for line in r.stdout.splitlines() if line.strip().startswith("total"))
    assert total == ["total", "0", "0", "0"]  # collected, not run


def test_no_test_run_is_a_failure():
    """A -k that matches nothing runs zero tests: that proves nothing, so it fails, saying why."""
    r = run_kvt("example", "-q", "-k", "no_such_test")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no test ran" in r.stderr and "'no_such_test'" in r.stderr, r.stderr
