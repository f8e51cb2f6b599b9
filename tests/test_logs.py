"""kvt.logs: what the kvt command and its tools' children print for a log
record (before: the bare message, no time, level, module or process), and
that a program's own logging setup is left alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

KVT = Path(sys.executable).parent / "kvt"  # the console script of the venv running the tests
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) (kvt\.registry)\[(\d+)\]: "
                    r"backend 'host' ignores shared options \['not_a_host_option'\]$", re.M)


def _env(tmp_path: Path, **extra: str) -> dict:
    conf = tmp_path / "kvt.toml"
    conf.write_text("[options]\nnot_a_host_option = 1\n")  # shared options a backend ignores: an INFO record
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVT_")}
    return {**env, "COLUMNS": "200", "KVT_CONFIG": str(conf), **extra}


def test_records_name_time_level_module_and_process_in_the_tool_and_its_children(tmp_path):
    r = subprocess.run([str(KVT), "demo", "--backend", "host", "--blocks", "8", "--request-blocks", "4"],
                       capture_output=True, text=True, timeout=300, env=_env(tmp_path, KVT_LOG_LEVEL="info"))
    assert r.returncode == 0, r.stderr[-2000:]
    pids = {int(m.group(3)) for m in RECORD.finditer(r.stderr)}
    assert len(pids) >= 2, r.stderr[-2000:]  # the command itself, and the demo's children


def test_the_default_level_hides_info(tmp_path):
    r = subprocess.run([str(KVT), "demo", "--backend", "host", "--blocks", "8", "--request-blocks", "4"],
                       capture_output=True, text=True, timeout=300, env=_env(tmp_path))
    assert r.returncode == 0 and "ignores shared options" not in r.stderr, r.stderr[-2000:]


def test_a_level_that_is_not_one_is_a_config_error(tmp_path):
    r = subprocess.run([str(KVT), "backends"], capture_output=True, text=True, timeout=120,
                       env=_env(tmp_path, KVT_LOG_LEVEL="loud"))
    assert r.returncode == 2 and r.stderr.startswith("kvt: error: environment variable KVT_LOG_LEVEL='loud' "
                                                     "is not a log level; use one of DEBUG, INFO, WARNING, ERROR")


def test_a_program_with_its_own_logging_keeps_it():
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="mine %(message)s", level=logging.INFO)
        from kvt.logs import log_to_stderr
        log_to_stderr()
        logging.getLogger("kvt.x").warning("hello")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVT_LOG_LEVEL": "error"})
    assert r.returncode == 0 and r.stdout == "mine hello\n" and r.stderr == "", (r.stdout, r.stderr)
