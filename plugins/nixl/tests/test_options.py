"""Options from kvt configuration, capabilities as data, and availability."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from kvt.errors import BackendUnavailable, ConfigError, UnsupportedOperation
from kvt.types import Descs, MemKind, Op
from kvt_nixl import native
from kvt_nixl.backend import NixlBackend
from peerproc import BLOCK, NUM_BLOCKS, load, pattern, settle


@pytest.mark.parametrize("options, field", [
    ({"num_threads": -1}, "num_threads"), ({"backends": []}, "backends"), ({"backends": "UCX"}, "backends"),
    ({"backends": ["NO_SUCH_PLUGIN"]}, "NO_SUCH_PLUGIN"), ({"progress_thread": "yes"}, "progress_thread"),
    ({"ucx_env": {"PATH": "/x"}}, "UCX_"), ({"ucx_env": ["UCX_TLS"]}, "ucx_env"), ({"timeout": 0}, "timeout"),
    ({"backend_params": {"UCX": "none"}}, "backend_params"), ({"progress_delay_us": -1}, "progress_delay_us"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        NixlBackend("bad-options", options)


def test_ucx_env_reaches_ucx_and_is_restored():
    """A transport UCX does not have makes the UCX backend fail to start:
    proof the setting reached UCX.  Either way the environment is restored."""
    before = os.environ.get("UCX_TLS")
    with pytest.raises(BackendUnavailable, match="UCX_TLS"):
        NixlBackend("bad-tls", {"ucx_env": {"UCX_TLS": "no_such_transport"}})
    assert os.environ.get("UCX_TLS") == before


_DELAYS = """
import sys
from kvt_nixl import native
from kvt_nixl.backend import NixlBackend
bind = native.api().nixlBind
real, seen = bind.nixlAgent, []

def recording(name, config):  # what NIXL itself is handed (the availability probe runs no progress thread)
    if not name.startswith("kvt-nixl-probe"):
        seen.append(config.pthrDelay)
    return real(name, config)

bind.nixlAgent = recording
b = NixlBackend("delay", {"progress_delay_us": int(sys.argv[1])})
assert native.api().nixlBind is bind  # the bindings are restored after creation
print(seen)
"""


def test_nixl_is_handed_the_progress_delay():
    """nixl_agent hard-codes pthrDelay 0, so its progress thread spins (a
    whole core per idle agent); kvt hands NIXL the configured delay, with
    which the thread sleeps in poll (the CPU it saves:
    benchmarks/bench_nixl_idle.py)."""
    def delays(delay_us: int) -> list:
        out = subprocess.run([sys.executable, "-c", _DELAYS, str(delay_us)], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return json.loads(out.split("\n")[-2])

    assert delays(1000) == [1000]
    assert delays(250) == [250]
    assert delays(0) == [0]  # 0: NIXL's own default, left alone


def test_ucx_memory_hooks_off_on_cpu_hosts_unless_asked():
    from kvt_nixl.backend import _ucx_env

    if native.cuda_present():
        assert "UCX_MEM_EVENTS" not in _ucx_env({})
    else:
        assert _ucx_env({})["UCX_MEM_EVENTS"] == "no"
    given = {"UCX_MEM_EVENTS": "yes", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    assert _ucx_env(given) == given


def test_ucx_on_loopback_unless_interfaces_are_named(monkeypatch):
    """UCX's tcp transport serves any address of the process (docs/security.md)."""
    from kvt_nixl.backend import _ucx_env

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert _ucx_env({})["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")  # the operator's, in the environment: UCX reads it
    assert "UCX_NET_DEVICES" not in _ucx_env({})


def test_tcp_only_still_moves_bytes(make_backend, peer, local_buf):
    before = os.environ.get("UCX_TLS")
    b = make_backend(ucx_env={"UCX_TLS": "tcp,self"}, num_threads=1, progress_thread=False,
                     backend_params={"UCX": {"ucx_error_handling_mode": "peer"}})
    assert os.environ.get("UCX_TLS") == before
    b.register(Descs.from_buffers([local_buf]))
    name = load(b, peer)
    lp = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, range(NUM_BLOCKS)))
    rp = b.prep(name, peer.blocks(range(NUM_BLOCKS)))
    assert settle(b, b.transfer(Op.READ, lp, None, rp, None, notif=b"tcp")).done
    np.testing.assert_array_equal(local_buf, pattern())
    assert peer.call("take", b.agent_name, 1) == [b"tcp"]


def test_a_misspelt_option_is_refused_with_the_right_one(make_backend):
    with pytest.raises(ConfigError, match=r"no option 'progress_threads' \(did you mean 'progress_thread'\?\)"):
        make_backend(progress_threads=False)


def test_capabilities_are_data_and_enforced(make_backend):
    caps = NixlBackend.capabilities
    assert caps.ops == frozenset(Op) and caps.notifications and caps.remote and caps.local
    assert (MemKind.VRAM in caps.mem_kinds) == native.cuda_present()
    assert MemKind.DEVICE not in caps.mem_kinds
    b = make_backend()
    with pytest.raises(UnsupportedOperation, match="DEVICE"):
        b.register(Descs.from_regions(0x1000, 64, kind=MemKind.DEVICE))
    if not native.cuda_present():
        with pytest.raises(UnsupportedOperation, match="VRAM"):
            b.register(Descs.from_regions(0x1000, 64, kind=MemKind.VRAM))


def _availability_in_child(code: str, env: dict | None = None) -> dict:
    script = code + ("\nfrom kvt_nixl.backend import NixlBackend\nimport json\n"
                     "a = NixlBackend.availability()\ntry:\n    NixlBackend('x')\n    built = 'built'\n"
                     "except Exception as e:\n    built = type(e).__name__ + ': ' + str(e)\n"
                     "print(json.dumps({'usable': a.usable, 'reason': a.reason, 'built': built}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_usable_here():
    assert NixlBackend.availability().usable, NixlBackend.availability().reason


def test_says_why_when_nixl_cannot_be_imported():
    got = _availability_in_child("import sys; sys.modules['nixl'] = None  # as if not installed")
    assert not got["usable"] and "'nixl' package cannot be imported" in got["reason"]
    assert got["built"].startswith("BackendUnavailable") and "pip install nixl" in got["built"]


def test_says_why_when_there_is_no_ucx_plugin(tmp_path):
    got = _availability_in_child("", {"NIXL_PLUGIN_DIR": str(tmp_path)})
    assert not got["usable"] and "no UCX plugin" in got["reason"] and str(tmp_path) in got["reason"]
    assert got["built"].startswith("BackendUnavailable")
