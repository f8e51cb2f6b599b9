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


def test_declares_host_memory_only(backend):
    assert backend.capabilities.mem_kinds == {MemKind.DRAM}


@pytest.mark.parametrize("options", [{"error_handling": "sometimes"}, {"notif_queue": 0},
                                     {"ucx_env": {"TLS": "tcp"}}, {"ucx": "TLS=tcp"}])
def test_bad_options_are_config_errors(options):
    with pytest.raises(ConfigError):
        UcxBackend("x", options)  # rejected before UCX starts


@pytest.mark.parametrize("setting", [{"NO_SUCH_SETTING_XYZ": "1"}, {"TLS": "no_such_transport"}])
def test_ucx_refusing_its_settings_is_a_config_error(setting):
    with pytest.raises(ConfigError, match="UCX refused"):
        UcxBackend("x", {"ucx": {**setting, "NET_DEVICES": "lo"}}).close()


def test_ucx_env_takes_the_nixl_backends_spelling():
    UcxBackend("x", {"ucx_env": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}}).close()
    with pytest.raises(ConfigError, match="UCX refused"):
        UcxBackend("x", {"ucx_env": {"UCX_NO_SUCH_SETTING_XYZ": "1"}}).close()


@pytest.mark.parametrize("tls, shm", [(None, True), ("all", True), ("cma,tcp,self", True), ("posix,self", True),
                                      ("sm", True), ("tcp", False), ("tcp,self", False), ("rc,ud,self", False),
                                      ("^tcp", True), ("^sm", False), ("^cma,posix,sysv,xpmem,knem", False)])
def test_same_host_endpoints_use_peer_error_handling_only_without_same_host_transports(tls, shm, monkeypatch):
    # peer error handling lets a timed-out peer be force-closed (nothing lands after ERR),
    # but same-host transports lack it or are turned off by it
    from kvt_ucx.backend import _shm_possible

    monkeypatch.delenv("UCX_TLS", raising=False)
    assert _shm_possible({} if tls is None else {"TLS": tls}) is shm
    if tls is not None:
        monkeypatch.setenv("UCX_TLS", tls)
        assert _shm_possible({}) is shm


def test_ucx_status_codes_map_into_kvt_tree():
    assert isinstance(native.error_of(-25, "op"), PeerDisconnected)    # connection reset
    assert isinstance(native.error_of(-80, "op"), PeerDisconnected)    # endpoint timeout
    assert isinstance(native.error_of(-23, "op"), RemoteRejected)
    assert isinstance(native.error_of(-20, "op"), TimeoutError)
    err = native.error_of(-16, "op")
    assert type(err) is TransferError and "Request canceled" in str(err)


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


def test_without_libucx_it_says_why_it_is_unusable():
    code = ("import sys; sys.modules['libucx'] = None\n"
            "from kvt_ucx import UcxBackend\n"
            "from kvt.errors import BackendUnavailable\n"
            "a = UcxBackend.availability(); print(a.usable, a.reason)\n"
            "try:\n    UcxBackend('x')\nexcept BackendUnavailable as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("False the UCP binding kvt_ucx._ucp or libucx is not importable"), out
    assert "refused: the UCP binding" in out


def _fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_add_remote_racing_close_is_closed_error_and_frees_the_connection(make_backend):
    """add_remote connected outside the lock, then stored the peer without
    checking that close() had run meanwhile: it returned on a closed backend
    and the endpoint, keys, pidfd and epoch watch stayed open for good; or
    the closed worker's RuntimeError escaped and leaked the peer's pidfd."""
    import threading

    from kvt import memory

    other = make_backend("target")
    buf = memory.empty(1 << 16)
    other.register(Descs.from_buffers([buf]))
    md = other.local_metadata()
    for hold_after_connect in (True, False):
        b = make_backend()
        before = _fds()
        real, entered, go = b._connect if hold_after_connect else b._worker.connect, threading.Event(), threading.Event()

        def held(*args, real=real, first=hold_after_connect):
            out = real(*args) if first else None
            entered.set()
            assert go.wait(20)
            return out if first else real(*args)

        if hold_after_connect:  # connected: close() runs before the peer is stored
            b._connect = lambda md_, held=held: held(md_)
        else:  # close() runs before UCX connects (the C module raises RuntimeError)
            b._worker = type("W", (), {"connect": staticmethod(held), "__getattr__": lambda s, n: getattr(real.__self__, n)})()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", _outcome(b.add_remote, md)))
        t.start()
        assert entered.wait(10)
        if not hold_after_connect:
            b._worker = real.__self__
        b.close()
        go.set()
        t.join(20)
        assert isinstance(out["r"], ClosedError), out
        assert not b._peers
        assert _fds() <= before, f"{_fds() - before} descriptors left open ({hold_after_connect=})"


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def test_notify_and_get_notifs_racing_close_raise_kvt_errors(make_backend):
    """Past their closed check, the worker closed by close() on another
    thread: the C module's RuntimeError escaped."""
    from kvt import memory
    from kvt.errors import KvtError

    a, target = make_backend(), make_backend("target")
    target.register(Descs.from_buffers([memory.empty(4096)]))
    name = a.add_remote(target.local_metadata())
    a.close()
    a._closed = False  # as if close() ran right after the calls' own check
    for call in (lambda: a.notify(name, b"x"), a.get_notifs):
        try:
            call()
        except KvtError:
            pass
        else:
            raise AssertionError("a call on a closed worker returned")
    a._closed = True
