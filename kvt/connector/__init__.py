"""Engine connector: the engine-facing half of disaggregated prefill/decode,
on kvt's protocol so it runs on every backend.

``ConnectorScheduler`` runs next to an engine's scheduler and decides what
moves; ``ConnectorWorker`` runs in each TP rank and moves it.  They talk
through ``ConnectorMetadata`` (a msgspec struct), and engines talk to each
other through ``kv_transfer_params`` (``TransferParams``).  See
docs/integration.md for the calls in order.
"""

from .config import ConnectorConfig, KVCacheSpec
from .metadata import CONNECTOR_VERSION, ConnectorMetadata, ReadNotif, RecvRequest, RemoteSource, TransferParams
from .scheduler import ConnectorScheduler, EngineRequest, FinishedAggregator, Request
from .worker import ConnectorWorker

__all__ = ["ConnectorConfig", "KVCacheSpec", "CONNECTOR_VERSION", "ConnectorMetadata", "ReadNotif",
           "RecvRequest", "RemoteSource", "TransferParams", "ConnectorScheduler", "EngineRequest",
           "FinishedAggregator", "Request", "ConnectorWorker"]
