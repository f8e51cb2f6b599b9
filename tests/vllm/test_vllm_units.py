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
