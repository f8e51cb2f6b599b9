"""kvt.integrations.vllm without vLLM: the import fails with a clear kvt
error; the translations from vLLM's config and cache tensors; and the
adapter driven the way vLLM drives a connector, against the ``fake_vllm``
test double of vLLM's base classes, moving real blocks on the host backend."""

from __future__ import annotations

import importlib
import time
import types

import pytest
import torch

import fake_vllm
from fake_vllm import KVCacheBlocks, KVConnectorOutput, KVConnectorRole, Request, RequestStatus, vllm_config
from kvt import memory
from kvt.errors import ConfigError, InvalidArgument, KvtError
from kvt.integrations import IntegrationUnavailable, available
from kvt.integrations.vllm_support import caches_for_kvt, connector_config, head_layout_of, kv_layout_of

needs_no_vllm = pytest.mark.skipif(available("vllm"), reason="vLLM is installed here")


@needs_no_vllm
def test_import_without_vllm_says_what_to_install():
    with pytest.raises(IntegrationUnavailable, match="pip install vllm") as e:
        importlib.import_module("kvt.integrations.vllm")
    assert isinstance(e.value, ImportError) and isinstance(e.value, KvtError)


def test_config_from_vllm():
    cfg = connector_config(vllm_config("eng", tp=2, extra={"backend": "host", "abort_request_timeout": 9}))
    assert (cfg.engine_id, cfg.tp_size, cfg.backend, cfg.abort_request_timeout) == ("eng", 2, "host", 9.0)
    assert (cfg.kv.num_layers, cfg.kv.num_kv_heads, cfg.kv.head_dim, cfg.kv.dtype, cfg.kv.block_size) == (
        2, 4, 8, "float16", 4)
    assert cfg.kv.model == "toy/model" and not cfg.staging
    assert connector_config(vllm_config("m", mla=True)).kv.kv_layout == "mla"
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys \\['bogus'\\]"):
        connector_config(vllm_config("eng", extra={"bogus": 1}))
    bad = vllm_config("eng")
    bad.kv_transfer_config.engine_id = None
    with pytest.raises(ConfigError, match="engine_id"):
        connector_config(bad)


def test_vllm_cache_layouts():
    hnd = torch.zeros(2, 16, 4, 4, 8).transpose(2, 3)  # FlashAttention shape, HND memory
    nhd = torch.zeros(2, 16, 4, 4, 8)                  # FlashAttention shape, NHD memory
    joined = torch.zeros(16, 2, 4, 4, 8).transpose(2, 3)  # FlashInfer
    mla = torch.zeros(16, 4, 32)
    assert [kv_layout_of(t) for t in (hnd, nhd, joined, mla)] == ["split", "split", "joined", "mla"]
    assert [head_layout_of(t) for t in (hnd, nhd, joined, mla)] == ["HND", "NHD", "HND", "HND"]
    kv_layout, head_layout, head_dim, caches = caches_for_kvt({"a": hnd})
    k, v = caches["a"]
    assert (kv_layout, head_layout, head_dim, tuple(k.shape)) == ("split", "HND", 8, (16, 4, 4, 8))
    assert k.is_contiguous()
    with pytest.raises(InvalidArgument, match="neither HND nor NHD"):
        head_layout_of(torch.zeros(2, 16, 8, 4, 4).permute(0, 1, 4, 3, 2))
    with pytest.raises(InvalidArgument, match="unrecognised"):
        kv_layout_of(torch.zeros(3, 3, 3, 3), mla=True)


def test_vllm_packed_layouts():
    """vLLM 0.2x+: one logical (blocks, heads, size, head_k + head_v) tensor per layer."""
    lbhnc = torch.arange(16 * 2 * 32 * 128, dtype=torch.float32).reshape(16, 2, 32, 128)  # as shaped
    lbnhc = torch.zeros(16, 32, 2, 128).transpose(1, 2)  # tokens outside heads in memory
    assert [kv_layout_of(t) for t in (lbhnc, lbnhc)] == ["packed", "packed"]
    assert [head_layout_of(t) for t in (lbhnc, lbnhc)] == ["HND", "NHD"]
    kv_layout, head_layout, head_dim, caches = caches_for_kvt({"a": lbhnc, "b": lbnhc})
    assert (kv_layout, head_layout, head_dim) == ("packed", "HND", 128)
    assert caches["a"].data_ptr() == lbhnc.data_ptr() and caches["a"].is_contiguous()
    assert torch.equal(caches["a"][3, 1], lbhnc[3, 1])  # block 3, head 1: K|V of every token
    assert caches_for_kvt({"b": lbnhc})[3]["b"].shape == (16, 32, 2, 128)
    mla = torch.zeros(16, 1, 32, 576)  # MLA in the same logical shape, one "head"
    assert (kv_layout_of(mla, mla=True), caches_for_kvt({"m": mla}, mla=True)[3]["m"].shape) == ("mla", (16, 32, 576))
    with pytest.raises(InvalidArgument, match="LBHNC"):  # block-outermost (BLHNC): layers interleaved
        head_layout_of(torch.zeros(16, 2, 2, 32, 128)[:, 0])


def _fa_caches(fill: bool) -> dict:
    out = {}
    for i in range(2):
        t = memory.empty_tensor((2, 16, 4, 4, 8), torch.float16)  # HND memory ...
        if fill:
            t.copy_(torch.randn(t.shape).half())
        out[f"model.layers.{i}.self_attn.attn"] = t.transpose(2, 3)  # ... behind vLLM's NHD-shaped view
    return out


def _step(sched, worker, out, scheduler_output=None):
    """One vLLM engine step: metadata from the scheduler to the worker and back."""
    worker.bind_connector_metadata(sched.build_connector_meta(scheduler_output))
    worker.start_load_kv(None)
    worker.wait_for_save()
    sending, recving = worker.get_finished(set())
    sched.update_connector_output(KVConnectorOutput(sending, recving))
    worker.clear_connector_metadata()
    out[0] |= sending or set()
    out[1] |= recving or set()


@pytest.fixture
def engines(monkeypatch):
    """A prefill and a decode vLLM instance (scheduler + worker connector
    each) on the host backend; ``kv_buffer_device`` per engine."""
    fake_vllm.install(monkeypatch)
    from kvt.integrations.vllm import KvtConnector

    made = []

    def make(kv_buffer_device="cuda"):
        sides = {}
        for name, fill in (("prefill", True), ("decode", False)):
            cfg = vllm_config(name, kv_buffer_device=kv_buffer_device)
            sched, worker = KvtConnector(cfg, KVConnectorRole.SCHEDULER), KvtConnector(cfg, KVConnectorRole.WORKER)
            made.extend([sched, worker])
            caches = _fa_caches(fill)
            worker.register_kv_caches(caches)
            sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
            sides[name] = (sched, worker, caches, [set(), set()])
        return KvtConnector, sides["prefill"], sides["decode"]

    yield make
    for c in made:
        c.shutdown()


def _decode(prefill, decode, params, prompt_len, block_ids):
    psched, pworker, _, pout = prefill
    dsched, dworker, _, dout = decode
    dreq = Request("d1", prompt_len, params)
    n, load = dsched.get_num_new_matched_tokens(dreq, 0)
    assert load and n == len(params["remote_block_ids"]) * 4
    dsched.update_state_after_alloc(dreq, KVCacheBlocks(block_ids), n)
    deadline = time.monotonic() + 10
    while "d1" not in dout[1] or params["remote_request_id"] not in pout[0]:
        assert time.monotonic() < deadline, (pout, dout)
        _step(dsched, dworker, dout)
        _step(psched, pworker, pout)
    assert dworker.get_block_ids_with_load_errors() == set()
    return dreq


def test_adapter_moves_a_request_like_vllm_would(engines):
    KvtConnector, prefill, decode = engines()
    assert KvtConnector.get_required_kvcache_layout(vllm_config("p")) in ("HND", "LBHNC")
    psched, pworker, pkv, pout = prefill
    dsched, _, dkv, _ = decode
    preq = Request("p1", 10, {"do_remote_decode": True})
    psched.update_state_after_alloc(preq, KVCacheBlocks([2, 4, 6]), 0)
    _step(psched, pworker, pout)
    delay, params = psched.request_finished(preq, [2, 4, 6])
    assert delay and params["remote_block_ids"] == [2, 4]
    dreq = _decode(prefill, decode, params, 10, [0, 1, 3])
    for name in pkv:
        assert torch.equal(dkv[name][:, [0, 1]], pkv[name][:, [2, 4]])
    # the decode request's blocks are vLLM's to free; an aborted prefill is not handed off
    assert dsched.request_finished(dreq, [0, 1, 3]) == (False, None)
    aborted = Request("p2", 10, {"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    assert psched.request_finished(aborted, [1, 3, 5]) == (False, None)
    # a prefill whose one token was a stop token is handed off too; null fields (vLLM's proxy) are absent ones
    stopped = Request("p3", 10, {"do_remote_decode": True, "remote_block_ids": None, "remote_engine_id": None},
                      status=RequestStatus.FINISHED_STOPPED)
    delay, params = psched.request_finished(stopped, [1, 3, 5])
    assert delay and params["remote_block_ids"] == [1, 3]


def test_malformed_params_are_refused_loudly(engines, caplog):
    """From a router: computed locally (never a crashed scheduler), logged as
    an error naming the request, and counted in the connector's stats."""
    _, _, decode = engines()
    dsched = decode[0]
    junk = Request("d2", 10, {"do_remote_prefill": True, "remote_block_ids": [1]})
    assert dsched.get_num_new_matched_tokens(junk, 0) == (0, False) and junk.kv_transfer_params is None
    assert any(r.levelname == "ERROR" and "d2" in r.getMessage() and "REFUSED" in r.getMessage()
               for r in caplog.records)
    bad_type = Request("d3", 10, {"do_remote_prefill": True, "remote_block_ids": "nope"})
    assert dsched.get_num_new_matched_tokens(bad_type, 0) == (0, False)
    assert dsched._malformed == 2


def test_adapter_stages_every_chunk_of_a_chunked_prefill(engines):
    _, prefill, decode = engines(kv_buffer_device="cpu")
    psched, pworker, pkv, pout = prefill
    preq = Request("p1", 16, {"do_remote_decode": True})
    psched.update_state_after_alloc(preq, KVCacheBlocks([2, 4]), 0)  # first chunk
    _step(psched, pworker, pout)
    later = types.SimpleNamespace(scheduled_cached_reqs=types.SimpleNamespace(req_ids=["p1"],
                                                                             new_block_ids=[([6, 9],)]))
    _step(psched, pworker, pout, later)  # second chunk: vLLM reports only the new blocks
    delay, params = psched.request_finished(preq, [2, 4, 6, 9])
    assert delay and params["remote_block_ids"] == [2, 4, 6, 9]
    _decode(prefill, decode, params, 16, [0, 1, 3, 5])
    for name in pkv:
        assert torch.equal(decode[2][name][:, [0, 1, 3, 5]], pkv[name][:, [2, 4, 6, 9]])
