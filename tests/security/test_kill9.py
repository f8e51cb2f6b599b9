"""A peer killed with SIGKILL mid-READ: the survivor ends the READ in ERR
within its timeout, every time, and never aborts.  ``KVT_KILL9_RUNS`` sets
runs per backend (default 3 in CI; 20 on demand)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RUNS = int(os.environ.get("KVT_KILL9_RUNS", "3"))
TIMEOUT = 3.0


@pytest.mark.timeout(60 + RUNS * 40)
@pytest.mark.parametrize("backend", ["host", "nixl", "ucx"])
def test_peer_killed_mid_read(backend):
    if backend != "host" and importlib.util.find_spec(f"kvt_{backend}") is None:
        pytest.skip(f"the {backend} plugin is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "kill9.py"), backend, str(RUNS), str(TIMEOUT)],
                          capture_output=True, text=True, timeout=30 + RUNS * 40, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count('"held": true') == RUNS, proc.stdout
