"""Wire format: the messages kvt agents exchange, as msgspec structs.

Every message is a msgpack map carrying ``v`` (the wire version) and ``t``
(its type tag).  Decoding reads the version first, so bytes from a newer or
older kvt fail with ``VersionMismatch`` rather than a confusing field error;
anything undecodable fails with ``WireError``.  Schema evolution: append
fields with defaults (old readers ignore them); bump ``WIRE_VERSION`` only
for a change old readers cannot survive.  Golden bytes live under
``tests/golden`` so an accidental format change fails a test.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

from .errors import VersionMismatch, WireError
from .types import Descs

__all__ = ["WIRE_VERSION", "Message", "BlockLayout", "AgentInfo", "HandshakeRequest",
           "HandshakeReply", "encode", "decode", "MAX_LAYOUT_ROWS", "MAX_PARTS"]

WIRE_VERSION = 1
#: most descriptor rows (blocks x regions) a peer's BlockLayout may describe: 16 Mi rows
#: (384 MiB of descriptors, e.g. 100,000 blocks x 160 K/V regions); more is refused at decode
MAX_LAYOUT_ROWS = 1 << 24
_MAX_ADDR = 1 << 64
#: most parts ``BlockLayout.sliced`` cuts a block into (the connector uses 1 or 2)
MAX_PARTS = 16


class Message(msgspec.Struct, frozen=True, tag_field="t", kw_only=True):
    """Base of every wire message: a version and a type tag."""

    v: int = WIRE_VERSION


class BlockLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How an agent's block-structured memory (e.g. a KV cache) is laid out.

    Block ``b`` of region ``r`` starts at ``base_addrs[r] + b * stride`` and is
    ``block_len`` bytes long; regions are typically one per layer (or per
    K and V of a layer).
    """

    base_addrs: list[int]
    block_len: int
    num_blocks: int
    stride: int
    device: int = 0
    kind: str = "DRAM"

    def __post_init__(self):
        # a peer's layout is untrusted: bound what descs() would allocate, and let no block wrap
        if self.block_len <= 0 or self.stride < 0 or self.num_blocks < 0 or not 0 <= self.device < _MAX_ADDR:
            raise ValueError(f"layout needs block_len > 0, stride >= 0, num_blocks >= 0 and a valid "
                             f"device (got {self.block_len}, {self.stride}, {self.num_blocks}, {self.device})")
        if not self.base_addrs or self.num_blocks * len(self.base_addrs) > MAX_LAYOUT_ROWS:
            # (no regions would let num_blocks be anything: descs() and block-id checks size arrays by it)
            raise ValueError(f"layout of {self.num_blocks} blocks x {len(self.base_addrs)} regions has no region "
                             f"or exceeds the limit of {MAX_LAYOUT_ROWS} descriptor rows")
        span = (self.num_blocks - 1) * self.stride + self.block_len if self.num_blocks else 0
        if any(not 0 <= b or b + span > _MAX_ADDR for b in self.base_addrs):
            raise ValueError("layout region runs past the top of the address space")
        if self.kind not in ("DRAM", "VRAM", "DEVICE"):
            raise ValueError(f"unknown memory kind {self.kind!r}")

    def sliced(self, parts: int, offset: int, length: int) -> "BlockLayout":
        """The layout whose block ``b`` of region ``i`` is bytes ``[offset,
        offset + length)`` of part ``i % parts`` of block ``b`` of region
        ``i // parts`` here, each block seen as ``parts`` equal parts (K and V
        of a joined block; a slice of heads).  ``ValueError`` unless that lies
        inside every part; at most ``MAX_PARTS`` parts."""
        if not (1 <= parts <= MAX_PARTS and self.block_len % parts == 0 and 0 <= offset and length > 0
                and offset + length <= self.block_len // parts):
            raise ValueError(f"bytes [{offset}, {offset} + {length}) of {parts} parts (at most {MAX_PARTS}) do "
                             f"not lie inside {self.block_len} B blocks split evenly")
        part_len = self.block_len // parts
        bases = (np.asarray(self.base_addrs, np.uint64)[:, None]
                 + np.arange(parts, dtype=np.uint64)[None, :] * np.uint64(part_len)).ravel() + np.uint64(offset)
        return BlockLayout(base_addrs=bases.tolist(), block_len=length, num_blocks=self.num_blocks,
                           stride=self.stride, device=self.device, kind=self.kind)

    def descs(self) -> Descs:
        """Every block of every region, region-major (one numpy broadcast)."""
        return Descs.from_blocks(self.base_addrs, self.block_len, np.arange(self.num_blocks),
                                 stride=self.stride, device=self.device, kind=self.kind)


class AgentInfo(Message, tag="agent_info"):
    """Everything a peer needs to reach an agent: its backend's opaque
    metadata plus the block layouts it exposes and free-form extras (the
    connector puts its compatibility fields there)."""

    name: str
    backend: str
    metadata: bytes
    layouts: dict[str, BlockLayout] = {}
    extra: dict[str, Any] = {}


class HandshakeRequest(Message, tag="hs_req"):
    """Ask a peer for its ``AgentInfo`` (``want`` selects what, for extensions)."""

    sender: str = ""
    want: str = "agent_info"


class HandshakeReply(Message, tag="hs_reply"):
    """Answer to a ``HandshakeRequest``: a payload or an error text."""

    payload: bytes = b""
    error: str = ""


class _Envelope(msgspec.Struct):
    v: int
    t: str


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(_Envelope)
M = TypeVar("M", bound=Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type: type[M]) -> M:  # noqa: A002 - mirrors msgspec's API
    """Decode ``data`` as ``type``; typed errors for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {data.__class__.__name__}")
    try:
        env = _envelope.decode(data)
    except Exception as e:  # noqa: BLE001 - DecodeError, and RecursionError/MemoryError on hostile nesting
        raise WireError(f"malformed kvt message ({len(data)} bytes): {e.__class__.__name__}: {str(e)[:512]}") from e
    if env.v != WIRE_VERSION:
        raise VersionMismatch(f"peer speaks kvt wire version {env.v}, this kvt speaks {WIRE_VERSION}; "
                              "run the same kvt release on both sides")
    try:
        return msgspec.msgpack.decode(data, type=type)
    except Exception as e:  # noqa: BLE001 - ValidationError (__post_init__ too), RecursionError, ...
        # a peer's text, cut short: it goes into logs and back to the peer
        raise WireError(f"malformed {type.__name__} (tag {env.t[:64]!r}): {e.__class__.__name__}: "
                        f"{str(e)[:512]}") from e
