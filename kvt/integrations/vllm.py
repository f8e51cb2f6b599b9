"""kvt as a vLLM KV connector (``KVConnectorBase_V1``), for disaggregated
prefill/decode on any kvt backend.  kvt registers it with vLLM's connector
factory through the ``vllm.general_plugins`` entry point, so the name is
enough (``kv_connector_module_path: "kvt.integrations.vllm"`` works too)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "nixl"}}'

Everything is delegated to ``kvt.connector``: ``ConnectorScheduler`` in the
scheduler process, ``ConnectorWorker`` in each worker.  The workers' handshake
endpoints reach the scheduler through vLLM's handshake-metadata channel
(``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``) unless
``side_channel_port`` fixes them.  See docs/integration.md.

Importing this module without vLLM raises ``IntegrationUnavailable``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import require

require("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole)

from ..connector import ConnectorMetadata, ConnectorScheduler, ConnectorWorker  # noqa: E402
from ..errors import ConfigError, InvalidArgument  # noqa: E402
from .vllm_support import caches_for_kvt, connector_config, request_identity  # noqa: E402

try:  # vLLM >= 0.11: hybrid allocator, metrics, transfer results
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults, SupportsHMA
    from .vllm_metrics import KvtConnectorStats, KvtPromMetrics
except ImportError:  # older vLLM: the adapter works without them
    KVConnectorTransferResults = KvtConnectorStats = KvtPromMetrics = None  # type: ignore[assignment,misc]

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in where vLLM predates the hybrid allocator."""

if TYPE_CHECKING:
    import torch

__all__ = ["KvtConnector", "KvtConnectorMetadata", "KvtHandshakeMetadata"]

log = logging.getLogger(__name__)


@dataclass
class KvtConnectorMetadata(KVConnectorMetadata):
    """One step's ``ConnectorMetadata``, msgpack-encoded; and the requests
    whose load could not even start (request id -> the blocks it would have
    written), which every worker reports as failed receives."""

    payload: bytes
    failed_loads: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class KvtHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where a worker serves its kvt handshake, and its agent's name."""

    tp_rank: int
    endpoint: str
    agent: str = ""


#: how a prefill request may end and still hand its blocks off (by name: vLLM's RequestStatus)
HANDOFF_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
#: characters of a request's kv_transfer_params quoted in a log line (an HTTP client sends any size)
LOGGED_PARAMS_CHARS = 512


def _quoted(params: Any) -> str:
    text = repr(params)
    return text if len(text) <= LOGGED_PARAMS_CHARS else f"{text[:LOGGED_PARAMS_CHARS]}... ({len(text)} characters)"


class KvtConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's view of kvt's engine connector.

    Hybrid allocator (``SupportsHMA``): kvt moves one KV cache group, so it
    runs with vLLM's hybrid KV cache manager on for models whose layers all
    share one group, and refuses (``ConfigError``) models with several."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:
            raise ConfigError(f"KvtConnector moves one KV cache group; this model has {len(groups)} (hybrid "
                              "attention); start vLLM with --disable-hybrid-kv-cache-manager")
        self._vllm_config = vllm_config
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._handshake: KvtHandshakeMetadata | None = None
        self._host_copy: Any = None  # vLLM's set_host_xfer_buffer_ops
        # counted since the last get_kv_connector_stats: params refused (scheduler side),
        # failed receives and the worker's expired sends so far (worker side)
        self._malformed = self._failed = self._expired_seen = 0
        self._staged: dict[str, tuple[Any, list[int]]] = {}  # prefill requests whose blocks are host-staged
        self._failed_loads: dict[str, list[int]] = {}  # scheduler: loads that could not start, for the next step
        self._failed_reported: set[int] = set()  # worker: their blocks, for get_block_ids_with_load_errors
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(connector_config(vllm_config), request_identity)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # heads outermost inside a block and layers apart (vLLM's LBHNC, "HND" before
        # 0.2x), so a block is one contiguous run and heterogeneous TP reads one slice of it
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        try:
            from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401
        except ImportError:
            return "HND"
        return "LBHNC"

    # -- scheduler side -------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except InvalidArgument as e:  # a bad request must not stop the engine: prefill it here instead
            log.error("request %s: REFUSED its kv_transfer_params %s: %s; the decode engine computes the whole "
                      "prompt itself (fix the router that sends them)", request.request_id,
                      _quoted(request.kv_transfer_params), e)
            self._malformed += 1
            request.kv_transfer_params = None
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        groups = blocks.get_block_ids()
        ids = list(groups[0]) if groups else []  # one group (see __init__)
        try:
            self._scheduler.update_state_after_alloc(request, ids, num_external_tokens)
        except InvalidArgument as e:  # never into vLLM's step, which it would kill
            self._not_loading(request, ids, num_external_tokens, e)
            return
        if self._scheduler.config.staging and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._staged[request.request_id] = (request, ids)

    def _not_loading(self, request: Any, ids: list[int], num_external_tokens: int, why: Exception) -> None:
        """``update_state_after_alloc`` found nothing it can read into ``ids``.

        With no tokens to load vLLM computes the request itself — e.g. one
        asking for ``prompt_logprobs`` (vLLM skips cached KV for those) whose
        long prompt it allocates chunk by chunk: the prefill side is told to
        free its blocks, as after a full prefix hit.  A request vLLM parked
        for a load (``num_external_tokens > 0``) is reported by every worker
        as a failed receive, with the blocks that load would have written,
        so vLLM fails or recomputes it (``kv_load_failure_policy``) instead
        of waiting for it for good."""
        req_id = request.request_id
        if num_external_tokens > 0:
            log.error("request %s: its KV load cannot start: %s; it fails as a failed load", req_id, why)
            need = -(-num_external_tokens // self._scheduler.config.kv.block_size)
            self._failed_loads[req_id] = ids[max(len(ids) - need, 0):]
        else:
            log.info("request %s: vLLM computes it without its prefill engine's KV (%s)", req_id, why)
        if (request.kv_transfer_params or {}).get("do_remote_prefill"):
            # one hand-off per request: what a request that ended before its read was scheduled does
            self._scheduler.request_finished(request, [], aborted=False)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        # vLLM calls update_state_after_alloc once; later chunks of a staged prefill
        # arrive as new blocks of a scheduled request, and must be staged too
        # (a request resumed after preemption gets its whole new block list instead)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", ())
        for req_id, new in zip(getattr(cached, "req_ids", ()), getattr(cached, "new_block_ids", ())):
            if req_id in self._staged and new:
                request, ids = self._staged[req_id]
                if req_id in resumed:
                    ids[:] = new[0]
                else:
                    ids.extend(new[0])
                self._scheduler.update_state_after_alloc(request, ids, 0)
        failed, self._failed_loads = self._failed_loads, {}
        return KvtConnectorMetadata(self._scheduler.build_connector_meta().encode(), failed)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output.finished_sending or (),
                                                connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        producer = bool(params.get("do_remote_decode"))
        self._staged.pop(request.request_id, None)
        # a prefill request is handed off when it finished normally (its token limit or a stop
        # token); aborted, errored or preempted ones are freed at once
        aborted = producer and getattr(request.status, "name", None) not in HANDOFF_STATUSES
        delay, out = self._scheduler.request_finished(request, block_ids, aborted=aborted)
        # vLLM itself keeps the blocks of a request still WAITING_FOR_REMOTE_KVS
        return (delay and producer), out

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: one group only (checked in ``__init__``)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_worker_endpoints({rank: m.endpoint for rank, m in metadata.items()},
                                             {rank: m.agent for rank, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """What vLLM >= 0.2x calls: ``{(pp_rank, tp_rank): metadata}``."""
        if any(pp for pp, _ in metadata):
            raise ConfigError("KvtConnector moves KV between tensor-parallel ranks of one pipeline stage; "
                              "run vLLM with pipeline_parallel_size 1 on both engines")
        self.set_xfer_handshake_metadata({tp: m for (_, tp), m in metadata.items()})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return None if KvtConnectorStats is None else KvtConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        if KvtPromMetrics is None:
            return None
        return KvtPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        mla = bool(getattr(self._vllm_config.model_config, "use_mla", False))
        kv_layout, head_layout, head_dim, caches = caches_for_kvt(kv_caches, mla)
        config = connector_config(self._vllm_config, kv_layout=kv_layout, head_layout=head_layout,
                                  head_dim=head_dim if kv_layout == "packed" else None)
        rank = get_tensor_model_parallel_rank()
        self._worker = ConnectorWorker(config, rank, copy_blocks=self._copy_blocks)
        self._handshake = KvtHandshakeMetadata(rank, self._worker.register_kv_caches(caches),
                                               self._worker.agent.name)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Host staging copies with vLLM's platform ops (kvt's torch copies until set)."""
        self._host_copy = copy_operation

    def _copy_blocks(self, src: Any, dst: Any, block_ids: Any, direction: str) -> None:
        if self._host_copy is None:
            from ..connector.staging import copy_blocks
            return copy_blocks(src, dst, block_ids, direction)
        ids = list(block_ids)
        self._host_copy({str(i): t for i, t in enumerate(src)}, {str(i): t for i, t in enumerate(dst)},
                        ids, ids, direction)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._handshake

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtConnectorMetadata):
            raise InvalidArgument(f"expected KvtConnectorMetadata from the scheduler, got {type(meta).__name__}")
        self._worker.start_load_kv(ConnectorMetadata.decode(meta.payload))
        self._failed_loads.update(meta.failed_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole requests load before they run; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The decode side pulls; nothing is pushed per layer."""

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def _results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving); logs and counts failures."""
        sending, recving = self._worker.get_finished()
        failed = self._worker.failure_reasons()
        for req_id, why in failed.items():
            log.warning("request %s: loading its KV from the prefill engine failed: %s", req_id, why)
        self._failed += len(failed)
        failed_recving = set(failed) & recving
        if self._failed_loads:  # loads the scheduler could not start (logged there)
            for ids in self._failed_loads.values():
                self._failed_reported.update(ids)
            self._failed += len(self._failed_loads)
            recving |= set(self._failed_loads)
            failed_recving |= set(self._failed_loads)
            self._failed_loads = {}
        return sending, recving, failed_recving

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished sends and receives, and which receives failed (their
        blocks are in ``get_block_ids_with_load_errors``; vLLM then fails
        or recomputes them by ``kv_load_failure_policy``)."""
        sending, recving, failed = self._results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_kv_connector_stats(self) -> Any:
        """What happened since the last call (``KvtConnectorStats``), or None:
        reads, their times and bytes, failures (worker); refused params (scheduler)."""
        if KvtConnectorStats is None:
            return None
        data: dict[str, Any] = {"num_malformed_params": self._malformed}
        self._malformed = 0
        if self._worker is not None:
            timings = self._worker.take_timings()
            expired, self._expired_seen = self._worker.stats["expired"] - self._expired_seen, self._worker.stats["expired"]
            data.update({
                "post_duration": [t[0] for t in timings], "transfer_duration": [t[1] for t in timings],
                "bytes_transferred": [t[2] for t in timings], "num_blocks": [t[3] for t in timings],
                "num_failed_recvs": self._failed, "num_expired_sends": expired})
            self._failed = 0
        stats = KvtConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_reported = self._worker.get_block_ids_with_load_errors() | self._failed_reported, set()
        return out

    def shutdown(self) -> None:
        """Release the worker's transfers, peers and registrations.  Never
        raises into vLLM's teardown (which stops at the first exception): at
        interpreter exit, where vLLM's finalizer may call it, thread pools
        refuse new work and a backend's close can fail."""
        if self._worker is not None:
            try:
                self._worker.shutdown()
            except Exception as e:
                log.warning("shutting down the kvt connector worker %s: %s: %s", self._worker.consumer,
                            type(e).__name__, e)
