"""The adapter's vLLM-facing pieces against the installed vLLM, without an engine."""

from __future__ import annotations

from kvt.integrations import vllm_plugin


def test_plugin_registers_kvt_connector_by_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm_plugin.register()
    vllm_plugin.register()  # vLLM calls it in every process; a second call is harmless
    from kvt.integrations.vllm import KvtConnector

    assert KVConnectorFactory.get_connector_class_by_name("KvtConnector") is KvtConnector


def test_stats_aggregate_and_reduce():
    from kvt.integrations.vllm import KvtConnector

    a = KvtConnector.build_kv_connector_stats({"transfer_duration": [0.01], "post_duration": [0.001],
                                               "bytes_transferred": [2**20], "num_blocks": [4]})
    b = KvtConnector.build_kv_connector_stats({"transfer_duration": [0.03], "post_duration": [0.001],
                                               "bytes_transferred": [2**20], "num_blocks": [4],
                                               "num_failed_recvs": 1})
    assert KvtConnector.build_kv_connector_stats().is_empty() and not a.is_empty()
    r = a.aggregate(b).reduce()
    assert (r["num_successful_transfers"], r["num_failed_recvs"], r["total_blocks"]) == (2, 1, 8)
    assert r["avg_xfer_time_ms"] == 20.0 and r["total_MB"] == 2.0 and r["throughput_MB_s"] == 50.0


def test_a_requests_identity_is_its_tokens_adapter_and_images():
    """What the hand-off's prompt_digest covers, on vLLM's own Request: the
    same tokens under another LoRA adapter, or with another image in the
    same placeholder, make other KV and must not load each other's."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvt.integrations.vllm_support import request_identity

    def req(tokens=(1, 2, 3, 4), lora=None, image=None, salt=None):
        mm = [MultiModalFeatureSpec(None, "image", image, PlaceholderRange(offset=1, length=2))] if image else None
        return Request(request_id="r", prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=1),
                       pooling_params=None, lora_request=lora, mm_features=mm, cache_salt=salt)

    base = request_identity(req())
    assert base == request_identity(req(salt="tenant-b"))  # the salt partitions the cache, not the KV
    others = [req(tokens=(1, 2, 3, 5)), req(lora=LoRARequest("a", 1, "/a")), req(lora=LoRARequest("b", 2, "/b")),
              req(image="img-1"), req(image="img-2")]
    assert len({base, *(request_identity(r) for r in others)}) == 1 + len(others)
    embeds = Request(request_id="e", prompt_token_ids=None, sampling_params=SamplingParams(max_tokens=1),
                     pooling_params=None, prompt_embeds=torch.zeros(4, 8))
    assert request_identity(embeds) is None
