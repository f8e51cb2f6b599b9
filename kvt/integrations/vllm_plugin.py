"""vLLM general plugin (entry point ``vllm.general_plugins``: ``kvt``):
registers ``KvtConnector`` with vLLM's connector factory, so
``{"kv_connector": "KvtConnector"}`` needs no ``kv_connector_module_path``.
vLLM calls ``register`` in each of its processes; importing the connector
itself is left to the factory (lazy)."""

from __future__ import annotations

__all__ = ["register"]

NAME, MODULE, CLASS = "KvtConnector", "kvt.integrations.vllm", "KvtConnector"


def register() -> None:
    """Register ``KvtConnector`` by name; a no-op if it already is."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:  # vLLM raises on a second registration
        KVConnectorFactory.register_connector(NAME, MODULE, CLASS)
