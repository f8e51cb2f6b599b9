"""The ucx backend's wire messages and UCX tag layout.

Every agent's worker receives control messages on one tag, ``CTRL_TAG``.
Data messages use ``(uid << 32) | seq``: ``uid`` is the initiator's random
31-bit id (so tags of different initiators never meet at a target) and
``seq`` counts the initiator's messages.  ``CTRL_TAG`` has the top bit set,
which no data tag has.

Messages are kvt.wire structs, so they carry its version field.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np
from kvt.wire import WIRE_VERSION, Message

__all__ = ["CTRL_TAG", "data_tag", "Ident", "UcxMetadata", "Request", "Reply", "Notif",
           "encode", "decode_ctrl", "rows_of"]

CTRL_TAG = 1 << 63
_SEQ_MASK = (1 << 32) - 1


def data_tag(uid: int, seq: int) -> int:
    return (uid << 32) | (seq & _SEQ_MASK)


class Ident(msgspec.Struct, frozen=True):
    """Who an agent is and how to reach it (and to tell whether it still lives)."""

    name: str
    address: bytes          # UCX worker address
    uid: int                # 1 .. 2**31-1, high half of its data tags
    host: str               # host_id(): equal means same host and same /proc view
    pid: int
    start: int              # start_time(pid), so a reused pid is not taken for the peer


class UcxMetadata(Message, tag="ucx_md"):
    """``local_metadata()``: identity plus registered memory by kind.  The
    control endpoint is the worker address with ``CTRL_TAG``."""

    ident: Ident
    regions: dict[str, bytes]  # memory kind -> (n, 3) uint64 rows (address, length, device)


class Request(Message, tag="ucx_req"):
    """Initiator -> target.  ``ranges`` are the target-side runs in message
    order ((k, 3) uint64), ``bounds`` the run index where each message starts
    and ends ((m+1,) int64), ``staged`` one byte per message."""

    src: Ident
    seq: int                # tag of message j is data_tag(src.uid, seq + j)
    op: str                 # "READ" | "WRITE"
    kind: str
    ranges: bytes
    bounds: bytes
    staged: bytes
    notif: bytes | None = None  # WRITE only: delivered at the target after the data


class Reply(Message, tag="ucx_rep"):
    """Target -> initiator about request ``seq``: ``ready`` (WRITE: receives
    posted, send the data), ``done`` (WRITE: data landed) or ``error``."""

    seq: int
    status: str
    src: str = ""           # the target's name: a reply must come from the transfer's peer
    error: str = ""
    code: str = ""          # "out_of_region" | "bad_request" | "busy"


class Notif(Message, tag="ucx_notif"):
    src: str
    msg: bytes


_encoder = msgspec.msgpack.Encoder()
_ctrl = msgspec.msgpack.Decoder(Union[Request, Reply, Notif])


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_ctrl(data) -> Request | Reply | Notif:
    """Decode a control message; ``msgspec.DecodeError`` or ``ValueError``
    (other wire version) for anything else."""
    msg = _ctrl.decode(data)
    if msg.v != WIRE_VERSION:
        raise ValueError(f"peer speaks kvt wire version {msg.v}, we speak {WIRE_VERSION}")
    return msg


def rows_of(data: bytes, width: int = 3, dtype=np.uint64) -> np.ndarray:
    """``(n, width)`` rows from packed bytes; ``ValueError`` if they do not divide."""
    item = np.dtype(dtype).itemsize * width
    if len(data) % item:
        raise ValueError(f"{len(data)} bytes are not a whole number of {width}-field rows")
    return np.frombuffer(data, dtype).reshape(-1, width)

