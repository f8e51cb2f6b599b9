"""The vLLM-specific translations the adapter needs, without importing vLLM
(so they are testable anywhere): vLLM's config -> ``ConnectorConfig``, and
vLLM's per-layer KV cache tensors -> the block-first buffers kvt registers.

vLLM lays KV caches out per attention backend:

* FlashAttention & co: ``(2, num_blocks, block_size, heads, head_dim)`` —
  K/V split; with the ``HND`` layout (which the adapter asks for) the
  memory is ``(2, num_blocks, heads, block_size, head_dim)`` behind a
  permuted view;
* FlashInfer: ``(num_blocks, 2, block_size, heads, head_dim)`` — K/V joined;
* MLA: ``(num_blocks, block_size, latent_dim)``.

``block_first`` finds the contiguous view of each, and ``head_layout`` tells
which of HND/NHD the memory really is.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..connector import ConnectorConfig, KVCacheSpec
from ..errors import ConfigError, InvalidArgument

__all__ = ["EXTRA_KEYS", "kv_layout_of", "head_layout_of", "block_first", "connector_config", "caches_for_kvt"]

#: ``kv_connector_extra_config`` keys the adapter reads (ConnectorConfig fields)
EXTRA_KEYS = ("backend", "backend_options", "side_channel_host", "side_channel_port", "abort_request_timeout",
              "expiry_margin", "handshake_timeout", "transfer_timeout")


def kv_layout_of(t: Any) -> str:
    """``split``, ``joined`` or ``mla`` from a vLLM layer cache's shape."""
    if t.ndim == 3:
        return "mla"
    if t.ndim == 5 and t.shape[0] == 2:
        return "split"
    if t.ndim == 5 and t.shape[1] == 2:
        return "joined"
    raise InvalidArgument(f"unrecognised vLLM KV cache shape {tuple(t.shape)}; expected (2, blocks, size, heads, "
                          "dim), (blocks, 2, size, heads, dim) or (blocks, size, latent)")


def _views(t: Any, layout: str) -> dict[str, Any]:
    """The cache as block-first views, by which layout they expose."""
    if layout == "mla":
        return {"HND": [t]}
    body = [t[0], t[1]] if layout == "split" else [t]
    nhd = body
    hnd = [x.transpose(-3, -2) for x in body]  # (.., size, heads, dim) -> (.., heads, size, dim)
    return {"NHD": nhd, "HND": hnd}


def head_layout_of(t: Any) -> str:
    """``HND`` or ``NHD``: which view of the cache is contiguous memory."""
    layout = kv_layout_of(t)
    if layout == "mla":
        return "HND"
    for name, views in _views(t, layout).items():
        if all(v.is_contiguous() for v in views):
            return name
    raise InvalidArgument(f"vLLM KV cache of shape {tuple(t.shape)} and strides {t.stride()} is neither HND "
                          "nor NHD contiguous; kvt registers contiguous block-first memory only")


def block_first(t: Any, head_layout: str) -> Any:
    """The value ``ConnectorWorker.register_kv_caches`` takes for this layer."""
    layout = kv_layout_of(t)
    views = _views(t, layout)[head_layout]
    return tuple(views) if layout == "split" else views[0]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def connector_config(vllm_config: Any, *, kv_layout: str = "split", head_layout: str = "HND") -> ConnectorConfig:
    """A ``ConnectorConfig`` from vLLM's ``VllmConfig`` (duck-typed).  The
    model shape comes from ``model_config``, the block size from
    ``cache_config``, the rest from ``kv_transfer_config`` and its
    ``kv_connector_extra_config`` (keys: ``EXTRA_KEYS``)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    ktc = vllm_config.kv_transfer_config
    if ktc is None or not getattr(ktc, "engine_id", None):
        raise ConfigError("vLLM's kv_transfer_config (with an engine_id) is required for the kvt connector")
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; the kvt connector reads {EXTRA_KEYS}")
    mla = bool(getattr(model, "use_mla", False))
    cache_dtype = getattr(cache, "cache_dtype", "auto")
    spec = KVCacheSpec(
        model=str(model.model), num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=1 if mla else model.get_total_num_kv_heads(), head_dim=model.get_head_size(),
        dtype=_dtype_name(model.dtype if cache_dtype in (None, "auto") else _cache_dtype(cache_dtype)),
        block_size=cache.block_size, kv_layout="mla" if mla else kv_layout, head_layout=head_layout)
    buffer_device = getattr(ktc, "kv_buffer_device", None)
    return ConnectorConfig.from_dict({
        "engine_id": str(ktc.engine_id), "kv": spec, "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "kv_buffer_device": "cpu" if buffer_device == "cpu" else None, **extra})


def _cache_dtype(name: str) -> str:
    """vLLM's ``--kv-cache-dtype`` names -> torch dtype names."""
    return {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
            "half": "float16", "bf16": "bfloat16"}.get(name, name)


def caches_for_kvt(kv_caches: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """``(kv_layout, head_layout, {layer: value for register_kv_caches})``."""
    if not kv_caches:
        raise InvalidArgument("vLLM passed no KV caches to register")
    first = next(iter(kv_caches.values()))
    kv_layout, head_layout = kv_layout_of(first), head_layout_of(first)
    return kv_layout, head_layout, {name: block_first(t, head_layout) for name, t in kv_caches.items()}
