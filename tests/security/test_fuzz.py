"""Mutated metadata, handshake, layout and request bytes fed to every decoder
and ``add_remote`` in a subprocess: only kvt errors, no crash, no hang.

``KVT_FUZZ_COUNT`` sets blobs per target (default 2,000; e.g. 10000 on
demand).  A blob that crashes or hangs the subprocess is saved under
``regressions/`` and replayed first from then on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
COUNT = int(os.environ.get("KVT_FUZZ_COUNT", "2000"))
SEED = int(os.environ.get("KVT_FUZZ_SEED", "1"))
TIMEOUT = 120 + COUNT * 0.05  # seconds for the whole run of one target


def _installed(plugin: str, native: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(plugin) is not None and importlib.util.find_spec(native) is not None


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("target", ["wire_agent_info", "wire_handshake", "host_add_remote", "host_server",
                                    "nixl_add_remote", "nixl_rkey", "nixl_address", "ucx_add_remote",
                                    "kv_transfer_params", "digest_request"])
def test_fuzz_target(target, tmp_path):
    if target.startswith("nixl") and not _installed("kvt_nixl", "nixl"):
        pytest.skip("the nixl plugin is not installed")
    if target.startswith("ucx") and not _installed("kvt_ucx", "libucx"):
        pytest.skip("the ucx plugin is not installed")
    progress = tmp_path / "progress"
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, str(HERE / "fuzz.py"), target, str(COUNT), str(SEED), str(progress)],
                              capture_output=True, text=True, timeout=TIMEOUT, env=env,
                              errors="replace")  # UCX logs the forged bytes it chokes on
        failure = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        failure = f"hung for {TIMEOUT:.0f}s"
    if failure is None:
        assert progress.read_bytes().strip() == b"done"
        return
    label = progress.read_bytes().strip().decode() if progress.exists() else "?"
    if label.isdigit():  # keep the blob that did it, to be replayed first from now on
        sys.path.insert(0, str(HERE))
        import fuzz
        blob = fuzz.blob_for(target, (tmp_path / "progress.seed").read_bytes(), SEED, int(label))
        (HERE / "regressions").mkdir(exist_ok=True)
        (HERE / "regressions" / f"{target}-{SEED}-{label}.bin").write_bytes(blob)
    pytest.fail(f"{target}: blob {label}: {failure}")
