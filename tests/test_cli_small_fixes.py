"""Small CLI defects: standard output that cannot be written, and counts
with no upper bound.  Each case runs the installed console script, as an
operator would, and failed before its fix (a traceback, a silent exit 0, or
an absurd count accepted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KVT = Path(sys.executable).parent / "kvt"  # the console script of the venv running the tests


def _env() -> dict:
    env = {**os.environ, "COLUMNS": "200"}
    for var in ("KVT_BACKEND", "KVT_CONFIG"):
        env.pop(var, None)
    return env


def _run(*args: str, stdout, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVT), *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=_env(),
                          timeout=timeout)


# -- standard output that cannot be written -------------------------------------------------------

COMMANDS = [("backends", "--json"), ("backends",), ("--help",), ("--version",), ("bench", "--help")]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_full_stdout_is_one_line_and_non_zero(args):
    # before: `kvt backends --json > /dev/full` ended in an OSError traceback (exit 1), and
    # `kvt --help > /dev/full` exited 0 as if it had printed (argparse ignores write errors)
    with open("/dev/full", "w") as full:
        r = _run(*args, stdout=full)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["kvt: error: cannot write to standard output: No space left on device"]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_closed_pipe_ends_quietly(args):
    # before: `kvt backends --json | head -c1` (the reader gone) ended in a BrokenPipeError traceback
    rd, wr = os.pipe()
    os.close(rd)  # nobody reads: every write fails with EPIPE
    try:
        r = _run(*args, stdout=wr)
    finally:
        os.close(wr)
    assert r.returncode == 1, r.stderr
    assert r.stderr == "", r.stderr


def test_writable_stdout_still_works(tmp_path):
    with open(tmp_path / "out.json", "w") as f:
        r = _run("backends", "--json", stdout=f)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.json").read_text().lstrip().startswith("[")


def test_other_oserrors_keep_their_traceback(monkeypatch):
    # only stdout's write errors are an operator's problem; any other OSError is a bug
    from kvt import cli

    def broken(args):
        raise OSError(5, "not stdout")

    monkeypatch.setattr(cli, "_main", lambda argv: broken(argv))
    with pytest.raises(OSError, match="not stdout"):
        cli.main(["backends"])


# -- counts with an upper bound --------------------------------------------------------------------

@pytest.mark.parametrize("args, named", [
    (("bench", "--rounds", "1000000000"), "--rounds must be in 1..100"),
    (("bench", "--rounds", "101"), "--rounds must be in 1..100"),
    (("bench", "--quick", "--rounds", "1000000000"), "--rounds must be in 1..100"),
    (("demo", "--iters", "1000000000"), "--iters must be at most 100,000,000"),
    (("demo", "--engine", "--requests", "1000000000"), "--requests must be at most 1,000,000"),
])
def test_absurd_counts_are_refused_naming_the_limit(args, named):
    # before: accepted; a bench of a billion rounds (or a demo of a billion reads) started running
    r = _run(*args, "--backend", "host", stdout=subprocess.PIPE)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("kvt: error: "), r.stderr
    assert named in r.stderr, r.stderr
    assert "kvt bench: " not in r.stderr  # the banner: no engine was started
