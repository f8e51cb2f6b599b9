"""Regressions from a red-team pass over the public API: each input here
escaped as a builtin exception (OverflowError, TypeError, RuntimeError,
AttributeError, UnicodeEncodeError...), was silently accepted as something
else, or left state behind.  Each test failed before its fix."""

from __future__ import annotations

import hashlib
import socket

import numpy as np
import pytest

from kvt import Agent, MemKind, memory
from kvt.backend import seconds
from kvt.config import Config, load_config
from kvt.connector import (ConnectorConfig, ConnectorMetadata, ConnectorScheduler, ConnectorWorker, EngineRequest,
                           KVCacheSpec, ReadNotif)
from kvt.errors import ConfigError, HandshakeError, InvalidArgument, WireError
from kvt.handshake import RouterServer
from kvt.types import Descs, as_index

try:  # imported once, at collection: the first import of torch takes seconds
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

KEY = "k" * 32
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", block_size=4)
TOKENS = list(range(16))
DIGEST = hashlib.blake2b(np.asarray(TOKENS, "<i8").tobytes(), digest_size=16, person=b"kvt-prompt").hexdigest()


# -- 3: timeouts too large for a float ------------------------------------------------------------

@pytest.mark.parametrize("timeout", [10**400, -10**400], ids=["huge", "-huge"])
def test_timeout_past_any_float_is_invalid_argument(timeout):
    # before: float(10**400) raised OverflowError out of Transfer.wait, wait_notif, connect, reconnect
    with pytest.raises(InvalidArgument, match="finite number of seconds"):
        seconds(timeout, "wait timeout")


def test_agent_waits_refuse_a_timeout_past_any_float():
    with Agent(name="hardening-timeout") as a:
        with pytest.raises(InvalidArgument):
            a.wait_notif(timeout=10**400)
        with pytest.raises(InvalidArgument):
            a.connect("tcp://127.0.0.1:1", timeout=-10**400)


# -- 4: numpy ints and floats as the scheduler's block ids ----------------------------------------

def _sched(engine_id):
    return ConnectorScheduler(ConnectorConfig(engine_id=engine_id, kv=SPEC, tp_size=1, backend="host"))


def _decode_request(req_id):
    return EngineRequest(req_id, 16, {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3, 4],
                                      "remote_engine_id": "p", "remote_request_id": f"r-{req_id}",
                                      "remote_endpoints": ["tcp://127.0.0.1:7000"], "prompt_digest": DIGEST}, TOKENS)


def test_prefill_hand_off_takes_numpy_int_block_ids():
    # before: request_finished raised TypeError at encode, after it had held the request for a reader
    p = _sched("p")
    p.set_worker_endpoints({0: "tcp://127.0.0.1:7000"}, {0: "p-tp0-abc"})
    delay, params = p.request_finished(EngineRequest("a", 16, {"do_remote_decode": True}, TOKENS),
                                       list(np.arange(4)))
    assert delay and params["remote_block_ids"] == [0, 1, 2, 3]
    assert all(type(i) is int for i in params["remote_block_ids"])
    ConnectorMetadata.decode(p.build_connector_meta().encode())


def test_decode_scheduler_takes_numpy_ints_and_refuses_floats_before_changing_anything():
    # before: numpy ints were kept and the step's metadata no longer encoded (every read of the
    # step lost); floats encoded as floats, which the worker's decode refused
    d = _sched("d")
    for req_id, ids in (("good", [0, 1, 2, 3]), ("numpy", list(np.arange(4, 8)))):
        req = _decode_request(req_id)
        n, _ = d.get_num_new_matched_tokens(req, 0)
        d.update_state_after_alloc(req, ids, n)
    bad = _decode_request("floats")
    n, _ = d.get_num_new_matched_tokens(bad, 0)
    with pytest.raises(InvalidArgument, match="block_ids"):
        d.update_state_after_alloc(bad, [0.5, 1.5, 2.5, 3.5], n)
    assert bad.kv_transfer_params["do_remote_prefill"]  # untouched: still to be scheduled
    meta = ConnectorMetadata.decode(d.build_connector_meta().encode())
    assert sorted(meta.reqs_to_recv) == ["good", "numpy"]
    assert meta.reqs_to_recv["numpy"].local_block_ids == [4, 5, 6, 7]


# -- 5: an auth_key that is not UTF-8 -----------------------------------------------------------

def test_auth_key_with_bytes_that_are_not_utf8_is_a_config_error_naming_it():
    # before: UnicodeEncodeError from Agent() (and in each process `kvt demo` started)
    with pytest.raises(ConfigError, match="auth_key.*KVT_AUTH_KEY") as e:
        load_config(env={"KVT_AUTH_KEY": KEY + "\udcff"})
    assert e.value.__cause__ is None and "\udcff" not in str(e.value)  # the key is not shown
    with pytest.raises(ConfigError, match="auth_key"):
        load_config(auth_key=KEY + "\ud800", env={})
    with pytest.raises(ConfigError, match="auth_key"):
        Config(auth_key=KEY + "\ud800")


# -- 7: what cannot be registered ---------------------------------------------------------------

@needs_torch
def test_sparse_tensor_is_refused_with_invalid_argument():
    sparse = torch.zeros(4, 8).to_sparse()
    with Agent(name="hardening-sparse") as a:
        with pytest.raises(InvalidArgument, match="dense"):
            a.register_blocks("s", [sparse])  # before: torch's RuntimeError
        with pytest.raises(InvalidArgument, match="dense"):
            a.register(sparse)


@pytest.mark.parametrize("kind", ["VRAM", "DEVICE", MemKind.VRAM])
def test_numpy_array_as_device_memory_is_refused_with_invalid_argument(kind):
    # before: AttributeError ('numpy.ndarray' object has no attribute 'detach') from the host backend
    with Agent(name="hardening-vram") as a:
        with pytest.raises(InvalidArgument, match="host memory"):
            a.register_blocks("v", [np.zeros((4, 8))], kind=kind)
        with pytest.raises(InvalidArgument, match="host memory"):
            a.register(np.zeros(64, np.uint8), kind=kind)
    assert Descs.from_buffers([np.zeros(8, np.uint8)], kind="DRAM").kind is MemKind.DRAM


# -- 8: listen's port and host ------------------------------------------------------------------

@pytest.mark.parametrize("host, port", [
    ("127.0.0.1", 99999), ("127.0.0.1", -1), ("127.0.0.1", 1.5), ("127.0.0.1", 2**70), ("127.0.0.1", True),
    ("127.0.0.1", "80"), ("\ud800", 0), ("", 0), (b"127.0.0.1", 0)])
def test_listen_refuses_a_port_or_host_it_cannot_bind(host, port):
    # before: 99999 returned an endpoint nothing listened on, -1 and 2**70 bound 65535, 1.5 bound 1,
    # a lone surrogate raised UnicodeEncodeError
    with Agent(name="hardening-listen") as a:
        with pytest.raises(InvalidArgument):
            a.listen(host, port)
        assert a.endpoint is None
    with pytest.raises(InvalidArgument):
        RouterServer(lambda frames: frames, host, port)


def test_listen_takes_numpy_int_port():
    with Agent(name="hardening-listen-ok") as a:
        assert a.listen("127.0.0.1", np.int64(0)).startswith("tcp://127.0.0.1:")


# -- 10: a worker whose listen failed can retry ---------------------------------------------------

@needs_torch
def test_worker_register_kv_caches_can_be_retried_after_listen_failed():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    w = ConnectorWorker(ConnectorConfig(engine_id="d", kv=SPEC, backend="host", side_channel_port=port), 0)
    try:
        kv = {f"l{i}": memory.empty_tensor((2, 16, *SPEC.block_shape(1)), torch.float16) for i in range(2)}
        with pytest.raises(HandshakeError, match="cannot listen"):
            w.register_kv_caches(kv)
        # before: a retry said "already called", endpoint stayed None and steps were accepted
        with pytest.raises(InvalidArgument, match="register_kv_caches"):
            w.start_load_kv(ConnectorMetadata())
        busy.close()
        assert w.register_kv_caches(kv) == f"tcp://127.0.0.1:{port}" == w.endpoint
        w.start_load_kv(ConnectorMetadata())
    finally:
        busy.close()
        w.shutdown()


# -- 11: memory.empty's shape and dtype ---------------------------------------------------------

@pytest.mark.parametrize("args", [((True,),), (True,), ((np.bool_(True), 4),), (4, "V0"), (4, "S0"), ((2, 2), "U0")])
def test_memory_empty_refuses_bool_dims_and_empty_dtypes(args):
    # before: TypeError (a bool dimension) and numpy's ValueError (0-byte items)
    with pytest.raises(InvalidArgument):
        memory.empty(*args)


def test_memory_empty_still_takes_numpy_int_dims():
    assert memory.empty((np.int32(2), 3), "f4").shape == (2, 3)


# -- 12: decoding what is not bytes -------------------------------------------------------------

@pytest.mark.parametrize("cls, data", [(ConnectorMetadata, None), (ReadNotif, "x"), (ConnectorMetadata, 5)])
def test_connector_messages_refuse_what_is_not_bytes_with_wire_error(cls, data):
    with pytest.raises(WireError):  # before: TypeError
        cls.decode(data)


# -- 13: raw rows -------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [[(4096.9, 8, 0)], [(4096.0, 8, 0)], [(-4096, 8, 0)], [(2**64, 8, 0)],
                                  [(4096, 8.5, 0)], [(1, 2)]])
def test_register_refuses_rows_that_are_not_u64_triples(rows):
    # before: (4096.9, 8, 0) registered address 4096
    with Agent(name="hardening-rows") as a:
        with pytest.raises(InvalidArgument):
            a.register(rows)


def test_raw_rows_keep_exact_u64_values_and_zero_lengths_as_from_regions():
    rows = Descs.coerce([(2**63 + 4096, 8, 0), (4096, 0, 1)])
    assert rows.array.tolist() == [[2**63 + 4096, 8, 0], [4096, 0, 1]]
    assert rows == Descs.from_regions([2**63 + 4096, 4096], [8, 0], [0, 1])  # zero length: as from_regions


# -- 14: as_index shows out-of-range ids as given -----------------------------------------------

@pytest.mark.parametrize("ids, shown", [
    ([2**63], "9223372036854775808"), (np.array([2**64 - 1], np.uint64), "18446744073709551615"),
    ([0, 2**64 - 1], "18446744073709551615")])
def test_as_index_message_shows_ids_as_given(ids, shown):
    with pytest.raises(InvalidArgument, match="out of range") as e:
        as_index(ids, 4)
    assert shown in str(e.value) and "-" not in str(e.value).split("got")[-1]
