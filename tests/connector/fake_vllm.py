"""Test double: the few vLLM modules and classes ``kvt.integrations.vllm``
imports, with vLLM's signatures (vllm/distributed/kv_transfer/kv_connector/
v1/base.py), so the adapter can be driven the way vLLM drives a connector on
a machine without vLLM.  ``install(monkeypatch)`` puts them in sys.modules."""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from dataclasses import dataclass
from typing import Any

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    pass


class KVConnectorHandshakeMetadata:
    pass


class KVConnectorBase_V1:
    def __init__(self, vllm_config, role, kv_cache_config=None):
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._role = role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata


class RequestStatus(enum.Enum):
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


@dataclass
class Request:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED


@dataclass
class KVCacheBlocks:
    ids: list[int]

    def get_block_ids(self):
        return (self.ids,)


@dataclass
class KVConnectorOutput:
    finished_sending: set | None = None
    finished_recving: set | None = None


class _TPRank:
    rank = 0


def vllm_config(engine_id: str, *, tp: int = 1, extra: dict | None = None, mla: bool = False,
                block_size: int = 4, heads: int = 4, head_size: int = 8, layers: int = 2, dtype: str = "float16",
                kv_buffer_device: str = "cuda"):
    """A duck-typed VllmConfig with the attributes the adapter reads."""
    import torch

    model = types.SimpleNamespace(
        model="toy/model", use_mla=mla, dtype=getattr(torch, dtype),
        get_total_num_hidden_layers=lambda: layers, get_total_num_kv_heads=lambda: heads,
        get_head_size=lambda: head_size)
    return types.SimpleNamespace(
        model_config=model, cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        kv_transfer_config=types.SimpleNamespace(engine_id=engine_id, kv_buffer_device=kv_buffer_device,
                                                 kv_connector_extra_config=dict(extra or {"backend": "host"})))


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__path__ = []  # a package, so submodules resolve
    mod.__dict__.update(attrs)
    return mod


def install(monkeypatch) -> None:
    parts = BASE.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), _module(".".join(parts[:i])))
    modules = {
        BASE: _module(BASE, KVConnectorBase_V1=KVConnectorBase_V1, KVConnectorMetadata=KVConnectorMetadata,
                      KVConnectorHandshakeMetadata=KVConnectorHandshakeMetadata, KVConnectorRole=KVConnectorRole),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.request": _module("vllm.v1.request", RequestStatus=RequestStatus),
        "vllm.distributed.parallel_state": _module(
            "vllm.distributed.parallel_state", get_tensor_model_parallel_rank=lambda: _TPRank.rank),
    }
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "kvt.integrations.vllm", raising=False)


__all__ = ["install", "vllm_config", "Request", "RequestStatus", "KVCacheBlocks", "KVConnectorOutput",
           "KVConnectorRole"]
