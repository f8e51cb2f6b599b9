"""Backends for the connector tests.

Every installed backend that can run here and declares what the connector
needs (READ, notifications, remote peers) is a test parameter.  Whether it
can run is asked in a subprocess: probing imports the plugin, and the nixl
and ucx plugins each bundle their own libucx, so neither may be loaded into
this process (the reference engine's workers are separate processes anyway).
``KVT_CONNECTOR_BACKENDS=host,nixl`` restricts the list.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from kvt.registry import list_backends

_PROBE = r"""
import json, sys
from kvt.registry import probe
s = probe(sys.argv[1])
c = s.capabilities
why = s.availability.reason if not s.usable else ""
if s.usable and not ("READ" in {o.value for o in c.ops} and c.notifications and c.remote):
    why = "does not declare READ, notifications and remote peers"
print("KVT-PROBE " + json.dumps(why))
"""


@functools.cache
def connector_backends() -> list:
    """``pytest.param`` per installed backend, skipped with the reason when unusable."""
    wanted = os.environ.get("KVT_CONNECTOR_BACKENDS")
    names = [b.name for b in list_backends()]
    if wanted:
        names = [n for n in names if n in wanted.split(",")]
    out = []
    for name in names:
        try:
            r = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True, timeout=120)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("KVT-PROBE ")]
            why = json.loads(lines[-1][10:]) if lines else f"probe failed: {r.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            why = "probe timed out"
        marks = [pytest.mark.skip(reason=f"backend {name!r}: {why}")] if why else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", connector_backends())


_NATIVE = ("nixl", "ucxx", "ucp", "kvt_nixl", "kvt_ucx")


@pytest.fixture(autouse=True)
def _no_native_backend_in_this_process():
    """The backends that bundle libucx run only in worker processes."""
    yield
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in _NATIVE)
    assert not loaded, f"the test process imported {loaded}; native backends belong in worker processes"
