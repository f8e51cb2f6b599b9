"""``KvtConnector`` driven the way vLLM 0.32's scheduler and model runner
drive a connector, without an engine: vLLM's own base classes and enums,
and small named doubles for the objects vLLM hands in (``VllmConfigDouble``,
``RequestDouble``, ``KVCacheBlocksDouble``, ``KVConnectorOutputDouble``).
The call orders and arguments are those of vllm/v1/core/sched/scheduler.py
and vllm/v1/worker/kv_connector_model_runner_mixin.py; the end-to-end tests
(test_vllm_hostile.py) confirm the important ones under a real engine."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvt import memory

BLOCK = 4


def vllm_config_double(engine_id: str, *, extra: dict | None = None, role: str = "kv_both") -> Any:
    """The attributes of a ``VllmConfig`` the adapter (and vLLM's base class) read."""
    model = types.SimpleNamespace(
        model="toy/model", use_mla=False, dtype=torch.float16,
        get_total_num_hidden_layers=lambda: 2, get_total_num_kv_heads=lambda: 4, get_head_size=lambda: 8)
    return types.SimpleNamespace(
        model_config=model, cache_config=types.SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        device_config=types.SimpleNamespace(device_type="cpu"),
        kv_transfer_config=types.SimpleNamespace(
            engine_id=engine_id, kv_buffer_device="cpu", kv_role=role, is_kv_producer=role != "kv_consumer",
            kv_connector_extra_config=dict(extra or {"backend": "host", "transfer_timeout": 5.0,
                                                     "handshake_timeout": 2.0})))


@dataclass
class RequestDouble:
    """vLLM's ``Request`` as a connector sees it."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    status: Any = None


@dataclass
class KVCacheBlocksDouble:
    """vLLM's ``KVCacheBlocks``: ``get_block_ids()`` gives one list per KV cache group."""

    groups: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def blocks(*ids: int) -> KVCacheBlocksDouble:
    return KVCacheBlocksDouble((list(ids),))


@dataclass
class KVConnectorOutputDouble:
    finished_sending: set | None = None
    finished_recving: set | None = None
    failed_recving: set = field(default_factory=set)


def remote_params(req: str, ids=(1, 2, 3), **more) -> dict:
    """Well-formed params of a prefill engine ``p`` (nothing listens there)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(ids),
            "remote_engine_id": "p", "remote_request_id": req, "remote_endpoints": ["tcp://127.0.0.1:9"],
            "tp_size": 1, **more}


@pytest.fixture
def scheduler():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvt.integrations.vllm import KvtConnector

    return KvtConnector(vllm_config_double("d"), KVConnectorRole.SCHEDULER)


def _recv_of(meta) -> dict:
    from kvt.connector import ConnectorMetadata

    return ConnectorMetadata.decode(meta.payload).reqs_to_recv


# -- update_state_after_alloc --------------------------------------------------

def test_update_state_after_alloc_with_nothing_to_load_and_a_first_chunk_of_blocks(scheduler):
    """vLLM computes a request itself — num_external_tokens 0 — when it skips
    reading cached KV (``prompt_logprobs``: skip_reading_prefix_cache), and then
    allocates only the first chunk of a long prompt (chunked prefill).  That
    must not raise into the engine's step (it killed the engine core); nothing
    is read and the prefill side is told to free its blocks."""
    req = RequestDouble("d1", 3 * BLOCK, remote_params("p1"))
    assert scheduler.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    scheduler.update_state_after_alloc(req, blocks(7), 0)  # vLLM ignored the hit; one block of a chunk
    recv = _recv_of(scheduler.build_connector_meta(None))
    assert list(recv) == ["d1"] and recv["d1"].local_block_ids == [] and recv["d1"].remote.request_id == "p1"
    assert not req.kv_transfer_params["do_remote_prefill"]  # one hand-off per request
    # the rest of its life is a local request's
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, blocks(7, 8, 9), 0)
    assert scheduler.request_finished(req, [7, 8, 9]) == (False, None)
    assert not _recv_of(scheduler.build_connector_meta(None))
    assert scheduler._scheduler.outstanding() == dict.fromkeys(("to_recv", "to_save", "to_send", "loading",
                                                                 "saving"), 0)


@pytest.mark.parametrize("params", ["do_remote_decode", ["x"], 5])
def test_params_that_are_not_an_object_do_not_raise_into_the_step(scheduler, params):
    """A client's kv_transfer_params may be any JSON value: request_finished
    called .get on them (AttributeError into vLLM's scheduler)."""
    req = RequestDouble("d1", 3 * BLOCK, params)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # refused: computed here
    scheduler.update_state_after_alloc(req, blocks(7, 8, 9), 0)
    assert scheduler.request_finished(req, [7, 8, 9]) == (False, None)
    # and a request that finishes without having been asked about (e.g. aborted while waiting)
    assert scheduler.request_finished(RequestDouble("d2", 3 * BLOCK, params), [1, 2, 3]) == (False, None)
    assert not _recv_of(scheduler.build_connector_meta(None))


def test_kv_role_from_vllm_decides_what_the_engine_does():
    """A ``kv_consumer`` (decode) engine asked to hold a request for readers
    runs it as a plain one (its blocks freed at once, not after
    ``abort_request_timeout``); a ``kv_producer`` refuses to load."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvt.integrations.vllm import KvtConnector

    decode = KvtConnector(vllm_config_double("d", role="kv_consumer"), KVConnectorRole.SCHEDULER)
    req = RequestDouble("r", 3 * BLOCK, {"do_remote_decode": True}, types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    decode.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    assert decode.request_finished(req, [1, 2, 3]) == (False, None)
    prefill = KvtConnector(vllm_config_double("p", role="kv_producer"), KVConnectorRole.SCHEDULER)
    req = RequestDouble("x", 3 * BLOCK, remote_params("x"))
    assert prefill.get_num_new_matched_tokens(req, 0) == (0, False)  # refused: computed here
    assert req.kv_transfer_params is None


def test_update_state_after_alloc_with_no_kv_cache_groups(scheduler):
    req = RequestDouble("d1", 3 * BLOCK, {"do_remote_decode": True})
    scheduler.update_state_after_alloc(req, KVCacheBlocksDouble(()), 0)
    scheduler.update_state_after_alloc(RequestDouble("d2", 3 * BLOCK, remote_params("p2")), KVCacheBlocksDouble(()), 0)


def test_update_state_after_alloc_that_cannot_start_the_load_fails_it(scheduler, worker_pair):
    """vLLM parked the request for a load (num_external_tokens > 0) the
    connector cannot start: it must not raise, and every worker reports the
    request finished receiving, failed, with its blocks invalid (vLLM then
    fails or recomputes it), never a request parked for good."""
    sched, worker = worker_pair
    req = RequestDouble("d1", 3 * BLOCK, remote_params("p1"))
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks(5, 6), 3 * BLOCK)  # fewer blocks than the load needs
    out = _worker_step(sched, worker)
    assert out.finished_recving == {"d1"} and out.failed_recving == {"d1"}
    assert out.invalid_block_ids == {5, 6}
    sched.update_connector_output(out)
    assert sched.request_finished(req, [5, 6]) == (False, None)
    assert _worker_step(sched, worker).finished_recving == set()  # reported once


# -- hostile params --------------------------------------------------------------

def test_refused_params_are_logged_once_and_bounded(scheduler, caplog):
    """Params from an HTTP client can be megabytes: the ERROR line that
    refuses them quotes a bounded prefix, not all of it."""
    junk = remote_params("p1", ids=[1] * 200_000 + [-1])
    req = RequestDouble("d1", 3 * BLOCK, junk)
    with caplog.at_level(logging.ERROR, logger="kvt.integrations.vllm"):
        for _ in range(3):  # vLLM asks again each step the request waits
            assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        scheduler.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    refusals = [r for r in caplog.records if "REFUSED" in r.getMessage()]
    assert len(refusals) == 1 and len(refusals[0].getMessage()) < 4096, len(refusals[0].getMessage())
    assert not _recv_of(scheduler.build_connector_meta(None))


# -- worker side -----------------------------------------------------------------

@pytest.fixture
def worker_pair(monkeypatch, engine_id: str = "d"):
    """(scheduler-role connector, worker-role connector) of one engine."""
    import vllm.distributed.parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvt.integrations.vllm import KvtConnector

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    cfg = vllm_config_double(engine_id)
    sched, worker = KvtConnector(cfg, KVConnectorRole.SCHEDULER), KvtConnector(cfg, KVConnectorRole.WORKER)
    caches = {f"model.layers.{i}.self_attn.attn": memory.empty_tensor((16, 4, BLOCK, 16), torch.float16)
              for i in range(2)}  # vLLM 0.32: (blocks, heads, block_size, head_k + head_v)
    worker.register_kv_caches(caches)
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    yield sched, worker
    worker.shutdown()
    sched.shutdown()


def _worker_step(sched, worker):
    """One model-runner step as kv_connector_model_runner_mixin makes it."""
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.wait_for_save()
    res = worker.get_transfer_results(set())
    out = types.SimpleNamespace(finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                                failed_recving=res.failed_recving,
                                invalid_block_ids=worker.get_block_ids_with_load_errors())
    worker.get_kv_connector_stats()
    worker.clear_connector_metadata()
    return out


_AT_EXIT = r'''
import atexit, sys, time, types
sys.path.insert(0, {here!r})
import test_vllm_adapter as t
import vllm.distributed.parallel_state as ps
ps.get_tensor_model_parallel_rank = lambda: 0
psched, pworker = next(t.worker_pair.__wrapped__(types.SimpleNamespace(setattr=setattr), "p"))
dsched, dworker = next(t.worker_pair.__wrapped__(types.SimpleNamespace(setattr=setattr), "d"))
params = {{**t.remote_params("p1"), "remote_endpoints": [pworker._worker.endpoint]}}
req = t.RequestDouble("d1", 3 * t.BLOCK, params)
dsched.get_num_new_matched_tokens(req, 0)
dsched.update_state_after_alloc(req, t.blocks(5, 6, 7), 3 * t.BLOCK)
deadline = time.monotonic() + 20
while not t._worker_step(dsched, dworker).finished_recving:  # connected: the backend has a peer to close
    t._worker_step(psched, pworker)
    assert time.monotonic() < deadline
atexit.register(pworker.shutdown)  # as vLLM's EngineCore finalizer does, at interpreter exit
atexit.register(dworker.shutdown)
print("ready", flush=True)
'''


def test_shutdown_at_interpreter_exit_does_not_raise_into_vllm():
    """vLLM shuts an engine that was not shut down explicitly (an offline
    ``LLM`` script's end) from a finalizer at interpreter exit, when thread
    pools refuse new work: the connector's shutdown must not raise there
    (it used to, out of the host backend's close, cutting vLLM's teardown)."""
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _AT_EXIT.format(here=here)], capture_output=True, text=True,
                          timeout=120, cwd=here)
    assert "ready" in proc.stdout, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


# -- host staging (prefill side, device KV cache) ---------------------------------

def test_staged_blocks_follow_chunks_and_a_resume_after_preemption():
    """With host staging, each step's newly filled blocks are saved; a request
    resumed after preemption gets its whole new block list (vLLM's
    ``resumed_req_ids``), which replaces the old one rather than extending it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvt.connector import ConnectorMetadata
    from kvt.integrations.vllm import KvtConnector

    config = vllm_config_double("p")
    config.device_config.device_type = "cuda"  # the scheduler side touches no device
    sched = KvtConnector(config, KVConnectorRole.SCHEDULER)

    def step(new_ids=None, resumed=()):
        cached = types.SimpleNamespace(req_ids=["r"] if new_ids else [], new_block_ids=[(new_ids,)] if new_ids else [],
                                       resumed_req_ids=set(resumed))
        meta = sched.build_connector_meta(types.SimpleNamespace(scheduled_cached_reqs=cached))
        return ConnectorMetadata.decode(meta.payload).reqs_to_save

    req = RequestDouble("r", 5 * BLOCK, {"do_remote_decode": True})
    sched.update_state_after_alloc(req, blocks(3, 4), 0)
    assert step() == {"r": [3, 4]}
    assert step([9]) == {"r": [4, 9]}  # the next chunk: block 4 grew, 9 is new
    # preempted, then resumed with block 3 from the prefix cache and new blocks after it
    sched.update_state_after_alloc(req, blocks(3, 7, 8), 0)
    assert step([3, 7, 8], resumed=["r"]) == {"r": [7, 8]}
    assert step([6]) == {"r": [8, 6]}
