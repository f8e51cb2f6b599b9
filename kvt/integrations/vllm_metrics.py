"""kvt's transfer statistics in vLLM's metrics: ``KvtConnectorStats`` (what
a worker reports each step, aggregated by vLLM's scheduler and logged as
"KV Transfer metrics") and ``KvtPromMetrics`` (the ``vllm:kvt_*`` Prometheus
series).  Imported by ``kvt.integrations.vllm``; needs vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["KvtConnectorStats", "KvtPromMetrics", "LISTS", "COUNTERS"]

#: per-read observations: post time, transfer time, bytes, blocks
LISTS = ("post_duration", "transfer_duration", "bytes_transferred", "num_blocks")
#: per-interval counts
COUNTERS = ("num_failed_recvs", "num_expired_sends", "num_malformed_params")


def _empty() -> dict[str, Any]:
    return {**{k: [] for k in LISTS}, **{k: 0 for k in COUNTERS}}


@dataclass
class KvtConnectorStats(KVConnectorStats):
    """One interval of kvt transfers (plain lists and ints: vLLM ships it
    between processes)."""

    def __post_init__(self) -> None:
        self.data = {**_empty(), **(self.data or {})}

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not (self.data["transfer_duration"] or any(self.data[k] for k in COUNTERS))

    def aggregate(self, other: KVConnectorStats) -> "KvtConnectorStats":
        for k in LISTS:
            self.data[k] = self.data[k] + list(other.data.get(k, ()))
        for k in COUNTERS:
            self.data[k] += int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n, secs, nbytes = len(d["transfer_duration"]), sum(d["transfer_duration"]), sum(d["bytes_transferred"])
        return {"num_successful_transfers": n, "num_failed_recvs": d["num_failed_recvs"],
                "num_expired_sends": d["num_expired_sends"], "num_malformed_params": d["num_malformed_params"],
                "avg_xfer_time_ms": round(1e3 * secs / n, 3) if n else 0.0,
                "avg_post_time_ms": round(1e3 * sum(d["post_duration"]) / n, 3) if n else 0.0,
                "total_MB": round(nbytes / 2**20, 3), "throughput_MB_s": round(nbytes / 2**20 / secs, 3) if secs else 0.0,
                "total_blocks": sum(d["num_blocks"])}


class KvtPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvt_xfer_time_seconds``, ``vllm:kvt_post_time_seconds``,
    ``vllm:kvt_bytes_transferred`` (histograms) and
    ``vllm:kvt_num_failed_recvs``, ``vllm:kvt_num_expired_sends``,
    ``vllm:kvt_num_malformed_params`` (counters), per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        times = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]
        sizes = [2.0**e for e in range(12, 34, 2)]
        self._hist = {
            "transfer_duration": self._per_engine(self._histogram_cls(
                name="vllm:kvt_xfer_time_seconds", documentation="kvt KV read time, post to completion",
                buckets=times, labelnames=labelnames)),
            "post_duration": self._per_engine(self._histogram_cls(
                name="vllm:kvt_post_time_seconds", documentation="kvt KV read post time",
                buckets=times, labelnames=labelnames)),
            "bytes_transferred": self._per_engine(self._histogram_cls(
                name="vllm:kvt_bytes_transferred", documentation="bytes per kvt KV read",
                buckets=sizes, labelnames=labelnames)),
        }
        self._counters = {k: self._per_engine(self._counter_cls(
            name=f"vllm:kvt_{k}", documentation=f"kvt connector: {k.replace('_', ' ')}", labelnames=labelnames))
            for k in COUNTERS}

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, hist in self._hist.items():
            for value in transfer_stats_data.get(key, ()):
                hist[engine_idx].observe(value)
        for key, counter in self._counters.items():
            if n := int(transfer_stats_data.get(key, 0)):
                counter[engine_idx].inc(n)
