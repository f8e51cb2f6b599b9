"""Messages of the connector, as msgspec structs.

* ``TransferParams`` — a request's ``kv_transfer_params``: what the prefill
  engine returns with a finished request and the decode engine receives with
  the new one (through the router, usually as JSON).  Field names follow
  vLLM's NixlConnector so routers written for it work unchanged; kvt adds
  ``remote_endpoints``, ``remote_agents``, ``expires_at`` and ``kvt_version``.
* ``ConnectorMetadata`` — what the scheduler side hands its workers each step.
* ``ReadNotif`` — what a decode rank tells a prefill rank when it is done
  with a request's blocks (attached to the read, or alone).
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Mapping

import msgspec
from msgspec import Meta

from ..auth import Secret
from ..errors import InvalidArgument, WireError

__all__ = ["CONNECTOR_VERSION", "MAX_TP", "TransferParams", "RemoteSource", "RecvRequest",
           "ConnectorMetadata", "ReadNotif"]

#: bump when prefill and decode sides of different versions cannot pair
CONNECTOR_VERSION = 3  # 2: params carry prompt_digest; 3: remote_agents; kvt_mac covers both
#: the largest prefill tensor-parallel size ``kv_transfer_params`` may name
MAX_TP = 1024

# kv_transfer_params reach the decode engine from whoever sends it requests:
# bound what they can make it build or connect to
_Id = Annotated[str, Meta(max_length=1024)]
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Endpoint = Annotated[str, Meta(max_length=300, pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$")]  # what kvt's side channel serves
_BlockId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
_AgentName = Annotated[str, Meta(max_length=256)]
_PARAMS_LABEL = b"kv_transfer_params"


class TransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's ``kv_transfer_params``.

    To the prefill engine: ``{"do_remote_decode": true}``.  Back from it (and
    on to the decode engine): ``do_remote_prefill`` plus where to read from.
    ``expires_at`` is wall-clock time (``time.time()``) at which the prefill
    side frees the blocks; it assumes the two hosts' clocks agree (NTP) to
    well within ``expiry_margin``.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: list[_BlockId] = []
    remote_engine_id: _Id | None = None
    remote_request_id: _Id | None = None
    remote_host: Annotated[str, Meta(max_length=255, pattern=r"^[^\s/]+$")] | None = None
    remote_port: _Port | None = None
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1
    remote_endpoints: Annotated[list[_Endpoint], Meta(max_length=MAX_TP)] = []
    #: the agent name of each prefill rank that holds the blocks: a name is drawn anew at each
    #: start, so a decode engine never reads these block ids from a restarted process
    remote_agents: Annotated[list[_AgentName], Meta(max_length=MAX_TP)] = []
    expires_at: Annotated[float, Meta(ge=0, le=1e11)] | None = None  # finite: NaN never compares
    kvt_version: int = CONNECTOR_VERSION
    #: BLAKE2b-128 of the prompt the prefill engine computed (``prompt_identity``); the decode
    #: request's prompt must match it: params obtained for one prompt cannot fill another's blocks
    prompt_digest: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")] | None = None
    #: the prefill engine's tag over where to read and for which prompt (engines with ``auth_key``)
    kvt_mac: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")] | None = None

    def __post_init__(self) -> None:
        # runs on parse too: a ValueError here is a ValidationError there
        if any(not 1 <= int(e.rsplit(":", 1)[1]) <= 65535 for e in self.remote_endpoints):
            raise ValueError("remote_endpoints need tcp://host:port with a port of 1..65535")
        if self.remote_port and self.remote_port + self.tp_size - 1 > 65535:
            raise ValueError(f"remote_port {self.remote_port} + tp_size {self.tp_size} passes port 65535")
        # Python's json keeps lone surrogates ("\ud800"), which no wire encodes: refused here, not
        # as a UnicodeEncodeError out of the engine's scheduler step (signing, the step's metadata)
        try:
            for text in (self.remote_engine_id, self.remote_request_id, self.remote_host, *self.remote_endpoints,
                         *self.remote_agents):
                if text is not None:
                    text.encode()
        except UnicodeEncodeError:
            raise ValueError("text that is not valid Unicode (a lone surrogate)") from None

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> "TransferParams | None":
        """``None`` for no params; ``InvalidArgument`` for malformed ones
        (wrong types, ``tp_size`` outside 1..``MAX_TP``, ports outside
        1..65535, endpoints other than ``tcp://host:port``, negative block
        ids, ids over 1,024 characters).  Unknown keys (a router's own) are
        ignored, and so are null values (as vLLM's NixlConnector treats them)."""
        if not params:
            return None
        if not isinstance(params, Mapping):
            raise InvalidArgument(f"malformed kv_transfer_params: a {type(params).__name__}, not a JSON object")
        try:  # a null field is an absent one (vLLM's proxies send "remote_block_ids": null)
            return msgspec.convert({k: v for k, v in dict(params).items() if v is not None}, cls, strict=False)
        except msgspec.ValidationError as e:
            raise InvalidArgument(f"malformed kv_transfer_params: {e}") from e
        except UnicodeError as e:  # a lone surrogate where msgspec wanted a number
            raise InvalidArgument(f"malformed kv_transfer_params: text that is not valid Unicode: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def endpoints(self) -> list[str]:
        """Per-rank handshake endpoints of the prefill engine."""
        if self.remote_endpoints:
            return list(self.remote_endpoints)
        if self.remote_host and self.remote_port:
            return [f"tcp://{self.remote_host}:{self.remote_port + r}" for r in range(self.tp_size)]
        return []

    def _signed(self) -> bytes:
        # everything that says what to read and from whom (not the do_* flags, which engines flip)
        return msgspec.msgpack.encode((self.kvt_version, self.remote_engine_id, self.remote_request_id,
                                       self.remote_block_ids, self.endpoints(), self.tp_size, self.expires_at,
                                       self.prompt_digest, self.remote_agents))

    def sign(self, secret: Secret | None) -> "TransferParams":
        """These params with ``kvt_mac`` set (unchanged without a secret)."""
        if secret is None:
            return self
        return msgspec.structs.replace(self, kvt_mac=secret.sign(_PARAMS_LABEL, self._signed()).hex())

    def source_problem(self, secret: Secret | None = None) -> str | None:
        """Why these params cannot be read from, or None.  With ``secret``
        (the engine's ``auth_key``) they must carry the prefill engine's tag:
        whoever sends the decode engine requests cannot then name blocks the
        prefill engine did not hand out."""
        if self.kvt_version != CONNECTOR_VERSION:
            return (f"kv_transfer_params come from kvt connector version {self.kvt_version}, this is "
                    f"{CONNECTOR_VERSION}; run the same kvt release on prefill and decode")
        if not self.remote_engine_id or not self.remote_request_id:
            return "kv_transfer_params lack remote_engine_id or remote_request_id"
        if len(self.endpoints()) != self.tp_size:
            return (f"kv_transfer_params give {len(self.endpoints())} endpoints for tp_size {self.tp_size}; "
                    "pass remote_endpoints (one per prefill rank) or remote_host and remote_port")
        if self.remote_agents and len(self.remote_agents) != self.tp_size:
            return (f"kv_transfer_params name {len(self.remote_agents)} remote_agents for tp_size {self.tp_size}; "
                    "pass the prefill engine's params on unchanged")
        if secret is not None:
            if self.kvt_mac is None:
                return ("kv_transfer_params carry no kvt_mac but this engine has an auth_key: set the same "
                        "auth_key (KVT_AUTH_KEY) on the prefill engine, and pass its params on unchanged")
            if not hmac.compare_digest(self.kvt_mac, secret.sign(_PARAMS_LABEL, self._signed()).hex()):
                return ("kv_transfer_params fail their kvt_mac check: altered or forged on the way, or the "
                        "prefill engine has another auth_key")
        return None


class RemoteSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode request's blocks live on the prefill engine."""

    engine_id: str
    request_id: str
    block_ids: list[int]   #: paired one to one with the local block ids
    endpoints: list[str]   #: handshake endpoint of each prefill rank
    tp_size: int
    expires_at: float | None = None
    agents: list[str] = []  #: agent name of each prefill rank (empty: not known, not checked)


class RecvRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A read to start.  No local blocks: only tell the prefill side it may
    free (full prefix hit, or the request was aborted before it was scheduled)."""

    local_block_ids: list[int]
    remote: RemoteSource


class _Packed:
    """msgpack ``encode`` / ``decode`` (``WireError`` for bad bytes) for a struct."""

    __slots__ = ()
    _what = "message"

    def encode(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def decode(cls, data: bytes):
        try:
            return _decoders[cls].decode(data)
        except msgspec.DecodeError as e:
            raise WireError(f"malformed {cls._what} ({len(data)} bytes): {e}") from e
        except TypeError:  # not bytes at all (None, a str): what arrived is not a message
            raise WireError(f"a {cls._what} is bytes (what encode() gives), got {type(data).__name__}") from None


class ConnectorMetadata(_Packed, msgspec.Struct, kw_only=True):
    """Scheduler -> workers, once per engine step."""

    _what = "connector metadata"

    reqs_to_recv: dict[str, RecvRequest] = {}
    #: prefill side with host staging: blocks to copy device -> host this step
    reqs_to_save: dict[str, list[int]] = {}
    #: prefill side: requests whose blocks are held for readers, until ``expires_at``
    reqs_to_send: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self.reqs_to_recv or self.reqs_to_save or self.reqs_to_send)


class ReadNotif(_Packed, msgspec.Struct, frozen=True, array_like=True, tag="kvt-read"):
    """Decode rank ``consumer`` (``"engine_id:rank"``) is done with prefill
    request ``request_id`` (``ok=False``: it gave up).  The prefill rank frees
    once every one of its ``consumer_tp``-derived readers has said so;
    repeats count once.  It counts a notification only from the agent of that
    decode rank (``engine_id-tp{rank}-...``), from a rank that reads from it,
    with the ``consumer_tp`` of the request's first notification; one for a
    request it released in the last minute is dropped."""

    _what = "kvt read notification"

    request_id: _Id
    consumer: Annotated[str, Meta(max_length=256)]
    consumer_tp: Annotated[int, Meta(ge=1, le=MAX_TP)]
    ok: bool = True


_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (ConnectorMetadata, ReadNotif)}
