"""The host backend's messages: its agent metadata and the requests its
server thread answers.  Built on kvt.wire, so they carry its version check."""

from __future__ import annotations

import numpy as np
from kvt.wire import Message


class HostMetadata(Message, tag="host_md"):
    """What a peer needs to reach a host-backend agent."""

    name: str
    endpoint: str                 # the agent's server (ZMQ ROUTER, tcp)
    host_id: str                  # kvt.procs.host_id(): same value = same host, /proc view and network
    pid: int
    start_time: int               # /proc/<pid>/stat start time, so a reused pid is not mistaken for us
    regions: dict[str, bytes]     # memory kind -> (n, 3) uint64 rows (address, length, device)
    segments: bytes = b""         # (m, 3) uint64 rows (base, size, fd) of shared segments peers may map


class Request(Message, tag="host_req"):
    """Initiator -> owner.  ``rows`` is a (k, 3) uint64 array in the owner's
    address space.  WRITE carries the payload as a second frame."""

    id: int
    sender: str
    op: str                       # "READ" | "WRITE" | "NOTIF"
    kind: str = "DRAM"
    rows: bytes = b""
    msg: bytes = b""


class Reply(Message, tag="host_rep"):
    """Owner -> initiator; READ carries the payload as a second frame."""

    id: int
    error: str = ""               # empty = success
    code: str = ""                # "out_of_region" | "bad_request"


def rows_of(data: bytes) -> np.ndarray:
    if len(data) % 24:
        raise ValueError(f"row payload of {len(data)} bytes is not a whole number of (addr, len, dev) rows")
    return np.frombuffer(data, np.uint64).reshape(-1, 3)
