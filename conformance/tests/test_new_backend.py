"""``kvt new-backend demo DIR && pip install -e DIR && kvt conformance demo``
end to end, in a throwaway venv layered over this one (so the venv running
the tests never gets the demo plugin installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("KVT_BACKEND", None)
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, env=env, **kw)


def test_new_backend_installs_and_its_stubs_fail_saying_what_to_implement(tmp_path):
    skeleton, venv = tmp_path / "kvt-demo", tmp_path / "venv"
    r = _run(Path(sys.executable).parent / "kvt", "new-backend", "demo", skeleton)
    assert r.returncode == 0, r.stderr
    assert (skeleton / "tests" / "test_conformance.py").read_text().count("class ") == 1
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = _run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    # the throwaway venv sees this venv's packages (kvt, the suite, pytest) through a .pth hook
    Path(purelib, "_kvt_tests.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    r = _run(sys.executable, "-m", "pip", "--python", py, "install", "--quiet", "--no-deps",
             "--no-build-isolation", "-e", skeleton)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(py, "-m", "kvt.cli", "conformance", "demo", "-q", "-o", "timeout=2", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = " ".join(r.stdout.split())  # rich wraps long lines
    assert "kvt conformance demo kvt-demo 0.1.0" in out
    assert "DemoBackend.register is not implemented yet: make the memory reachable by peers" in out
    assert "(see docs/plugin-guide.md, 'register')" in out
    # the plugin's own one-class test module runs the same suites
    r = _run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "test_register_and_deregister",
             skeleton / "tests", cwd=tmp_path)
    assert r.returncode == 1 and "DemoBackend.register is not implemented yet" in r.stdout, r.stdout[-2000:]
