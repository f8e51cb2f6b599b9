"""kvt as a vLLM KV connector (``KVConnectorBase_V1``), for disaggregated
prefill/decode on any kvt backend.  Load it with vLLM's
``kv_connector_module_path``::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtConnector",
        "kv_connector_module_path": "kvt.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "nixl"}}'

Everything is delegated to ``kvt.connector``: ``ConnectorScheduler`` in the
scheduler process, ``ConnectorWorker`` in each worker.  The workers' handshake
endpoints reach the scheduler through vLLM's handshake-metadata channel
(``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``) unless
``side_channel_port`` fixes them.  See docs/integration.md.

Importing this module without vLLM raises ``IntegrationUnavailable``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import require

require("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole)

from ..connector import ConnectorMetadata, ConnectorScheduler, ConnectorWorker  # noqa: E402
from ..errors import InvalidArgument  # noqa: E402
from .vllm_support import caches_for_kvt, connector_config  # noqa: E402

if TYPE_CHECKING:
    import torch

__all__ = ["KvtConnector", "KvtConnectorMetadata", "KvtHandshakeMetadata"]

log = logging.getLogger(__name__)


@dataclass
class KvtConnectorMetadata(KVConnectorMetadata):
    """One step's ``ConnectorMetadata``, msgpack-encoded."""

    payload: bytes


@dataclass
class KvtHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where a worker serves its kvt handshake."""

    tp_rank: int
    endpoint: str


class KvtConnector(KVConnectorBase_V1):
    """vLLM's view of kvt's engine connector."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._vllm_config = vllm_config
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._handshake: KvtHandshakeMetadata | None = None
        self._staged: dict[str, tuple[Any, list[int]]] = {}  # prefill requests whose blocks are host-staged
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(connector_config(vllm_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # heads outermost inside a block, so heterogeneous TP reads one slice
        model = getattr(vllm_config, "model_config", None)
        return None if model is None or getattr(model, "use_mla", False) else "HND"

    # -- scheduler side -------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except InvalidArgument as e:  # a bad request must not stop the engine: prefill it here instead
            log.warning("request %s: %s; computing its prompt locally", request.request_id, e)
            request.kv_transfer_params = None
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = list(blocks.get_block_ids()[0])
        self._scheduler.update_state_after_alloc(request, ids, num_external_tokens)
        if self._scheduler.config.staging and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._staged[request.request_id] = (request, ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        # vLLM calls update_state_after_alloc once; later chunks of a staged prefill
        # arrive as new blocks of a scheduled request, and must be staged too
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for req_id, new in zip(getattr(cached, "req_ids", ()), getattr(cached, "new_block_ids", ())):
            if req_id in self._staged and new:
                request, ids = self._staged[req_id]
                ids.extend(new[0])
                self._scheduler.update_state_after_alloc(request, ids, 0)
        return KvtConnectorMetadata(self._scheduler.build_connector_meta().encode())

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output.finished_sending or (),
                                                connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params or {}
        producer = bool(params.get("do_remote_decode"))
        self._staged.pop(request.request_id, None)
        # a prefill request is handed off only when it stopped at its one token
        aborted = producer and request.status != RequestStatus.FINISHED_LENGTH_CAPPED
        delay, out = self._scheduler.request_finished(request, block_ids, aborted=aborted)
        # vLLM itself keeps the blocks of a request still WAITING_FOR_REMOTE_KVS
        return (delay and producer), out

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_worker_endpoints({rank: m.endpoint for rank, m in metadata.items()})

    # -- worker side ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        kv_layout, head_layout, caches = caches_for_kvt(kv_caches)
        config = connector_config(self._vllm_config, kv_layout=kv_layout, head_layout=head_layout)
        rank = get_tensor_model_parallel_rank()
        self._worker = ConnectorWorker(config, rank)
        self._handshake = KvtHandshakeMetadata(rank, self._worker.register_kv_caches(caches))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._handshake

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtConnectorMetadata):
            raise InvalidArgument(f"expected KvtConnectorMetadata from the scheduler, got {type(meta).__name__}")
        self._worker.start_load_kv(ConnectorMetadata.decode(meta.payload))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole requests load before they run; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The decode side pulls; nothing is pushed per layer."""

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.get_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
