"""The vLLM-specific translations the adapter needs, without importing vLLM
(so they are testable anywhere): vLLM's config -> ``ConnectorConfig``, and
vLLM's per-layer KV cache tensors -> the block-first buffers kvt registers.

vLLM lays KV caches out per attention backend:

* FlashAttention & co: ``(2, num_blocks, block_size, heads, head_dim)`` —
  K/V split; with the ``HND`` layout (which the adapter asks for) the
  memory is ``(2, num_blocks, heads, block_size, head_dim)`` behind a
  permuted view;
* FlashInfer: ``(num_blocks, 2, block_size, heads, head_dim)`` — K/V joined;
* MLA: ``(num_blocks, block_size, latent_dim)``;
* vLLM >= 0.2x (RFC #42082): one logical ``(num_blocks, heads, block_size,
  content)`` tensor per layer, K and V packed in ``content`` (``head_size_k +
  head_size_v``; the MLA latent with ``heads == 1``).  Its physical order is
  the layout vLLM reports (``LBHNC``: as shaped; ``LBNHC``: tokens outside
  heads); kvt reads it from the strides.  Block-outermost layouts (``BLHNC``
  & co, every layer in one block) are not block-first per layer and are
  refused with the layout to ask for instead.

``block_first`` finds the contiguous view of each, and ``head_layout`` tells
which of HND/NHD the memory really is.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgspec

from ..connector import ConnectorConfig, KVCacheSpec
from ..connector.scheduler import prompt_identity
from ..errors import ConfigError, InvalidArgument

__all__ = ["EXTRA_KEYS", "kv_layout_of", "head_layout_of", "block_first", "connector_config", "caches_for_kvt",
           "request_identity"]

#: ``kv_connector_extra_config`` keys the adapter reads (ConnectorConfig fields)
EXTRA_KEYS = ("backend", "backend_options", "side_channel_host", "side_channel_port", "abort_request_timeout",
              "expiry_margin", "handshake_timeout", "transfer_timeout")


def kv_layout_of(t: Any, mla: bool = False) -> str:
    """``split``, ``joined``, ``packed`` or ``mla`` from a vLLM layer cache's
    shape (``mla``: the model uses MLA, which a 4-D cache does not show)."""
    if t.ndim == 3 or (t.ndim == 4 and mla and t.shape[1] == 1):
        return "mla"
    if t.ndim == 4 and not mla:
        return "packed"
    if t.ndim == 5 and t.shape[0] == 2:
        return "split"
    if t.ndim == 5 and t.shape[1] == 2:
        return "joined"
    raise InvalidArgument(f"unrecognised vLLM KV cache shape {tuple(t.shape)}; expected (blocks, heads, size, "
                          "head_k + head_v), (2, blocks, size, heads, dim), (blocks, 2, size, heads, dim), "
                          "(blocks, 1, size, latent) or (blocks, size, latent)")


def _views(t: Any, layout: str) -> dict[str, Any]:
    """The cache as block-first views, by which layout they expose."""
    if layout == "mla":
        return {"HND": [t[:, 0] if t.ndim == 4 else t]}
    if layout == "packed":  # logical (blocks, heads, size, content)
        return {"HND": [t], "NHD": [t.transpose(1, 2)]}
    body = [t[0], t[1]] if layout == "split" else [t]
    nhd = body
    hnd = [x.transpose(-3, -2) for x in body]  # (.., size, heads, dim) -> (.., heads, size, dim)
    return {"NHD": nhd, "HND": hnd}


def head_layout_of(t: Any, mla: bool = False) -> str:
    """``HND`` or ``NHD``: which view of the cache is contiguous memory."""
    layout = kv_layout_of(t, mla)
    for name, views in _views(t, layout).items():
        if all(v.is_contiguous() for v in views):
            return name
    raise InvalidArgument(f"vLLM KV cache of shape {tuple(t.shape)} and strides {t.stride()} is neither HND "
                          "nor NHD contiguous; kvt registers contiguous block-first memory per layer only: "
                          "run vLLM with kv_cache_layout LBHNC (the layout KvtConnector asks for) or LBNHC")


def block_first(t: Any, head_layout: str, mla: bool = False) -> Any:
    """The value ``ConnectorWorker.register_kv_caches`` takes for this layer."""
    layout = kv_layout_of(t, mla)
    views = _views(t, layout)[head_layout]
    return tuple(views) if layout == "split" else views[0]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def connector_config(vllm_config: Any, *, kv_layout: str = "split", head_layout: str = "HND",
                     head_dim: int | None = None) -> ConnectorConfig:
    """A ``ConnectorConfig`` from vLLM's ``VllmConfig`` (duck-typed).  The
    model shape comes from ``model_config``, the block size from
    ``cache_config``, the rest from ``kv_transfer_config`` and its
    ``kv_connector_extra_config`` (keys: ``EXTRA_KEYS``).  ``head_dim``
    overrides the model's (the packed layout's content is K and V together).

    Host staging is on only when ``kv_buffer_device`` is ``"cpu"`` and the
    cache is not host memory already (vLLM defaults ``kv_buffer_device`` to
    the platform, which is ``"cpu"`` on a CPU build)."""
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
        num_kv_heads=1 if mla else model.get_total_num_kv_heads(), head_dim=head_dim or model.get_head_size(),
        dtype=_dtype_name(model.dtype if cache_dtype in (None, "auto") else _cache_dtype(cache_dtype)),
        block_size=cache.block_size, kv_layout="mla" if mla else kv_layout, head_layout=head_layout)
    buffer_device = getattr(ktc, "kv_buffer_device", None)
    if getattr(getattr(vllm_config, "device_config", None), "device_type", None) == "cpu":
        buffer_device = None  # the cache is host memory: nothing to stage
    return ConnectorConfig.from_dict({
        "engine_id": str(ktc.engine_id), "kv": spec, "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "kv_role": getattr(ktc, "kv_role", None) or "kv_both",
        "kv_buffer_device": "cpu" if buffer_device == "cpu" else None, **extra})


def _cache_dtype(name: str) -> str:
    """vLLM's ``--kv-cache-dtype`` names -> torch dtype names."""
    return {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
            "half": "float16", "bf16": "bfloat16"}.get(name, name)


def caches_for_kvt(kv_caches: Mapping[str, Any], mla: bool = False) -> tuple[str, str, int, dict[str, Any]]:
    """``(kv_layout, head_layout, head_dim, {layer: value for
    register_kv_caches})``; ``head_dim`` is the last dimension of the cache
    (K and V together when packed)."""
    if not kv_caches:
        raise InvalidArgument("vLLM passed no KV caches to register")
    first = next(iter(kv_caches.values()))
    kv_layout, head_layout = kv_layout_of(first, mla), head_layout_of(first, mla)
    return kv_layout, head_layout, int(first.shape[-1]), {
        name: block_first(t, head_layout, mla) for name, t in kv_caches.items()}


def request_identity(request: Any) -> bytes | None:
    """What a vLLM request's KV is computed from: its prompt token ids, its
    LoRA adapter and its multimodal inputs with their places (what vLLM's own
    prefix-cache keys add to the tokens; ``cache_salt`` only partitions the
    cache, the KV does not depend on it).  Signed into the hand-off's params,
    so a client cannot present one prompt's params with another prompt."""
    tokens = prompt_identity(request)
    if tokens is None:
        return None
    lora = getattr(request, "lora_request", None)
    try:
        mm = [(str(f.identifier), int(f.mm_position.offset)) for f in getattr(request, "mm_features", None) or ()]
    except (AttributeError, TypeError, ValueError):  # a vLLM without these fields: tokens and adapter only
        mm = []
    adapter = (str(lora.lora_name), str(getattr(lora, "lora_path", ""))) if lora else None
    return tokens + msgspec.msgpack.encode((adapter, mm))
