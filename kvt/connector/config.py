"""What an engine tells the connector: the shape of its KV cache and how to
reach and treat its peers.

``KVCacheSpec`` is per engine (not per rank) and is what the handshake
compares: a prefill and a decode engine pair only if every field matches.
``ConnectorConfig`` adds the engine's identity, tensor parallelism, the kvt
backend and the lifetimes.  Both are msgspec structs, so an engine can build
them from a dict (``ConnectorConfig.from_dict``, e.g. vLLM's
``kv_connector_extra_config``); a bad value raises ``ConfigError`` naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

import msgspec

from ..config import Config, load_config
from ..errors import ConfigError

__all__ = ["KVCacheSpec", "ConnectorConfig"]

_Pos = Annotated[int, msgspec.Meta(gt=0)]
_Seconds = Annotated[float, msgspec.Meta(gt=0)]

#: bytes per element of the dtypes a KV cache uses (names as torch spells them)
DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "uint8": 1, "int8": 1}


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The KV cache of one engine (all ranks together).

    Per rank and per layer the cache is block-first:

    * ``kv_layout="split"``: K and V apart, each ``(num_blocks, *block)``
      (passed as a ``(2, num_blocks, *block)`` tensor or a ``(K, V)`` pair);
    * ``kv_layout="joined"``: ``(num_blocks, 2, *block)``;
    * ``kv_layout="packed"``: ``(num_blocks, *block)`` with K and V packed in
      the last dimension (``head_dim`` is then ``head_size_k + head_size_v``;
      vLLM's current layout);
    * ``kv_layout="mla"``: one latent cache ``(num_blocks, block_size, head_dim)``,
      replicated on every rank.

    ``block`` is ``(heads, block_size, head_dim)`` for ``head_layout="HND"``
    and ``(block_size, heads, head_dim)`` for ``"NHD"``; ``heads`` is
    ``num_kv_heads // tp_size``.  Heterogeneous TP slices heads inside a
    block, which needs ``HND`` bytes (MLA, one token per block or one head
    per rank lay bytes out as ``HND`` under either name).
    """

    model: str = ""
    num_layers: _Pos
    num_kv_heads: _Pos  #: all ranks together (1 for MLA)
    head_dim: _Pos      #: the latent dimension for MLA
    dtype: str
    block_size: _Pos    #: tokens per block
    kv_layout: Literal["split", "joined", "packed", "mla"] = "split"
    head_layout: Literal["HND", "NHD"] = "HND"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")

    @property
    def mla(self) -> bool:
        return self.kv_layout == "mla"

    def heads_per_rank(self, tp_size: int) -> int:
        return 1 if self.mla else self.num_kv_heads // tp_size

    def block_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of one block of one K (or V, or MLA latent) cache on one rank."""
        if self.mla:
            return (self.block_size, self.head_dim)
        h = self.heads_per_rank(tp_size)
        return (h, self.block_size, self.head_dim) if self.head_layout == "HND" else (self.block_size, h, self.head_dim)

    def part_bytes(self, tp_size: int) -> int:
        """Bytes of one block of one K/V part on one rank."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.block_shape(tp_size):
            n *= d
        return n

    @property
    def parts_per_layer(self) -> int:
        """K and V (2), or K|V packed or the MLA latent (1)."""
        return 1 if self.kv_layout in ("mla", "packed") else 2


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine's connector settings (the same on its scheduler and workers)."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]  # peers refuse reader names > 256
    kv: KVCacheSpec
    tp_size: _Pos = 1
    #: what this engine does with other engines' KV (vLLM's ``kv_role``): ``kv_producer`` never
    #: loads (``do_remote_prefill`` params are refused), ``kv_consumer`` never holds blocks for
    #: readers (``do_remote_decode`` is ignored), ``kv_both`` does either
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    #: kvt backend (None: KVT_BACKEND, the KVT_CONFIG file, or ``host``)
    backend: str | None = None
    backend_options: dict[str, Any] = {}
    #: ``"cpu"``: stage through host buffers (device -> host before send,
    #: host -> device after receive) for devices the backend cannot reach
    kv_buffer_device: str | None = None
    #: address peers dial for the handshake; rank r listens on ``side_channel_port + r``
    #: (0: any free port); the scheduler learns them, with each rank's agent name, from ``set_worker_endpoints``
    side_channel_host: str = "127.0.0.1"
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: seconds the prefill side holds a finished request's blocks for its readers
    abort_request_timeout: _Seconds = 480.0
    #: the decode side refuses (or invalidates) a read this close to the lease's end
    expiry_margin: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    #: None: as the kvt settings say (the ``KVT_CONFIG`` file's), else 5 s and 30 s; the worker
    #: uses its agent's (``agent.config``)
    handshake_timeout: _Seconds | None = None
    transfer_timeout: _Seconds | None = None

    def __post_init__(self) -> None:
        # built directly, fields are not type-checked (from_dict's conversion checks them all): the
        # two the checks below compute with must be right, or a ZeroDivisionError/AttributeError escapes
        if not isinstance(self.kv, KVCacheSpec) or type(self.tp_size) is not int or self.tp_size < 1:
            raise ConfigError(f"ConnectorConfig needs kv = a KVCacheSpec and tp_size = an int >= 1, got "
                              f"{type(self.kv).__name__} and {self.tp_size!r}; ConnectorConfig.from_dict checks "
                              "every field")
        if not self.kv.mla and self.kv.num_kv_heads % self.tp_size:
            raise ConfigError(f"num_kv_heads ({self.kv.num_kv_heads}) must be a multiple of tp_size "
                             f"({self.tp_size}): each rank holds an equal slice of heads")
        if self.side_channel_port and self.side_channel_port + self.tp_size - 1 > 65535:
            raise ConfigError(f"side_channel_port {self.side_channel_port} + tp_size exceeds 65535")

    def kvt_config(self, **overrides: Any) -> Config:
        """The kvt configuration of this engine's agents: ``backend``,
        ``backend_options`` and the timeouts from here where set, the rest
        (``auth_key`` above all) from ``KVT_*`` variables and the
        ``KVT_CONFIG`` file."""
        return load_config(backend=self.backend, options=self.backend_options or None,
                           handshake_timeout=self.handshake_timeout, transfer_timeout=self.transfer_timeout,
                           **overrides)

    @property
    def staging(self) -> bool:
        return self.kv_buffer_device == "cpu"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ConnectorConfig":
        """Validate ``values``; ``ConfigError`` names the bad field."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"connector configuration must be a mapping of settings, got {type(values).__name__}")
        try:
            return msgspec.convert(dict(values), cls, strict=False)
        except msgspec.ValidationError as e:
            raise ConfigError(f"invalid connector configuration: {e}") from e

    def endpoint(self, rank: int) -> str | None:
        """The handshake endpoint of ``rank`` when the port is fixed, else None."""
        if not self.side_channel_port:
            return None
        return f"tcp://{self.side_channel_host}:{self.side_channel_port + rank}"
