"""The backend's declarations, options and error mapping, and local transfers."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from kvt import registry
from kvt.errors import ClosedError, ConfigError, InvalidHandle, PeerDisconnected, RemoteRejected, TransferError, WireError
from kvt.types import Descs, MemKind, Op
from kvt_ucx import UcxBackend, native
from ucx_peer import settle


def test_entry_point_and_availability():
    assert registry.load_backend("ucx") is UcxBackend
    avail = UcxBackend.availability()
    assert avail.usable, avail.reason


def test_cuda_memory_declared_only_with_a_cuda_device(backend):
    has_vram = MemKind.VRAM in backend.capabilities.mem_kinds
    assert has_vram == (native.cuda_devices() > 0 and backend._engine.ctx.cuda_support)
    assert MemKind.DRAM in backend.capabilities.mem_kinds


@pytest.mark.parametrize("options", [{"error_handling": "sometimes"}, {"zcopy_min": 0},
                                     {"stage_max": "big"}, {"ucx": "TLS=tcp"}])
def test_bad_options_are_config_errors(options):
    with pytest.raises(ConfigError):
        UcxBackend("x", options)  # rejected before UCX starts


@pytest.mark.parametrize("setting", [{"NO_SUCH_SETTING_XYZ": "1"}, {"TLS": "no_such_transport"}])
def test_ucx_refusing_its_settings_is_a_config_error(setting):
    with pytest.raises(ConfigError, match="UCX refused"):
        UcxBackend("x", {"ucx": {**setting, "NET_DEVICES": "lo"}}).close()


def test_ucxx_errors_map_into_kvt_tree():
    api = native.load()
    assert isinstance(native.to_kvt(api.UCXConnectionResetError("x"), "op"), PeerDisconnected)
    assert isinstance(native.to_kvt(api.UCXRejectedError("x"), "op"), RemoteRejected)
    assert isinstance(native.to_kvt(api.UCXTimedOutError("x"), "op"), TimeoutError)
    err = native.to_kvt(api.UCXCanceledError("x"), "op")
    assert type(err) is TransferError and isinstance(err.__cause__, api.UCXCanceledError)


def test_malformed_metadata_is_a_wire_error(backend):
    with pytest.raises(WireError):
        backend.add_remote(b"\x00garbage")


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_local_transfer_loops_back_through_ucx(backend, op):
    a = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    b = np.zeros(1 << 16, np.uint8)
    backend.register(Descs.from_buffers([a]))
    backend.register(Descs.from_buffers([b]))
    pa = backend.prep(None, Descs.from_blocks(a.ctypes.data, 1024, np.arange(64)))
    pb = backend.prep(None, Descs.from_blocks(b.ctypes.data, 1024, np.arange(64)))
    ids = np.random.default_rng(1).permutation(64)
    # READ pulls from the "remote" list into the local one; WRITE pushes local into remote
    local, remote = (pb, pa) if op is Op.READ else (pa, pb)
    h = backend.transfer(op, local, ids, remote, np.arange(64))
    assert settle(backend, h, 10).done
    if op is Op.READ:
        np.testing.assert_array_equal(b.reshape(64, -1)[ids], a.reshape(64, -1))
    else:
        np.testing.assert_array_equal(b.reshape(64, -1), a.reshape(64, -1)[ids])
    backend.release(h)
    with pytest.raises(InvalidHandle):
        backend.release(h)


def test_close_is_idempotent_and_final(backend):
    backend.close()
    backend.close()
    with pytest.raises(ClosedError):
        backend.local_metadata()


def test_without_ucxx_it_says_why_it_is_unusable():
    code = ("import sys; sys.modules['ucxx'] = None\n"
            "from kvt_ucx import UcxBackend\n"
            "from kvt.errors import BackendUnavailable\n"
            "a = UcxBackend.availability(); print(a.usable, a.reason)\n"
            "try:\n    UcxBackend('x')\nexcept BackendUnavailable as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("False ucxx is not importable") and "pip install ucxx-cu12" in out
    assert "refused: ucxx is not importable" in out
