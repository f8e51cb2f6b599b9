"""The host backend's messages: its agent metadata and the requests its
server thread answers.  Built on kvt.wire, so they carry its version check."""

from __future__ import annotations

import numpy as np
from kvt.errors import WireError
from kvt.wire import Message

#: work one request may ask of the owner's server thread; initiators split bigger transfers
#: (so one peer's huge transfer is many requests, and ZMQ serves peers' requests in turn)
MAX_REQUEST_ROWS = 1 << 16
MAX_REQUEST_BYTES = 32 << 20
#: the biggest message the server accepts: a full WRITE plus its row table and envelope
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES + 24 * MAX_REQUEST_ROWS + (64 << 10)
MAX_NAME = 256  # characters of an agent name on the wire
#: shared segments one peer's metadata may list: each is one mapping here, and a process has
#: about 65,000 in all (vm.max_map_count); an engine's KV cache is a few segments per layer
MAX_SEGMENTS = 4096
#: up to this many rows, a request's slicing (``chunks``, ``stream._runs``) runs on Python ints
FEW_ROWS = 16


class HostMetadata(Message, tag="host_md"):
    """What a peer needs to reach a host-backend agent."""

    name: str
    endpoint: str                 # the agent's server (ZMQ ROUTER, tcp)
    host_id: str                  # kvt.procs.host_id(): same value = same host, /proc view and network
    pid: int
    start_time: int               # /proc/<pid>/stat start time, so a reused pid is not mistaken for us
    regions: dict[str, bytes]     # memory kind -> (n, 3) uint64 rows (address, length, device)
    segments: bytes = b""         # (m, 3) uint64 rows (base, size, fd) of shared segments peers may map
    epoch_fd: int = -1            # fd of its registration epoch page (kvt.epoch), for same-host peers
    epoch: int = 0                # the epoch when this metadata was taken
    notif: str = ""               # its notification socket (kvt_host.notifs), for same-host peers; "" = none


class Request(Message, tag="host_req"):
    """Initiator -> owner.  ``rows`` is a (k, 3) uint64 array in the owner's
    address space.  WRITE carries the payload as a second frame."""

    id: int
    sender: str
    op: str                       # "READ" | "WRITE" | "NOTIF" | "STREAM"
    kind: str = "DRAM"
    rows: bytes = b""
    msg: bytes = b""


class Reply(Message, tag="host_rep"):
    """Owner -> initiator; READ carries the payload as a second frame."""

    id: int
    error: str = ""               # empty = success
    code: str = ""                # "out_of_region" | "bad_request" | "unauthenticated" | ...
    port: int = 0                 # STREAM: where the data stream listens (the server's host) ...
    token: bytes = b""            # ... and the one-time token that opens it (kvt_host.stream)


def rows_of(data: bytes) -> np.ndarray:
    """A peer's ``(k, 3)`` uint64 row table (``WireError`` if it is not one)."""
    if len(data) % 24:
        raise WireError(f"row payload of {len(data)} bytes is not a whole number of (addr, len, dev) rows")
    return np.frombuffer(data, np.uint64).reshape(-1, 3)


def chunks(rows: np.ndarray, max_rows: int = MAX_REQUEST_ROWS, max_bytes: int = MAX_REQUEST_BYTES):
    """Split paired rows ``(k, 4)`` of ``(local address, remote address,
    length, remote device)`` into slices each within the server's per-request limits,
    cutting rows longer than half of ``max_bytes`` into pieces.  Vectorised:
    the Python loop runs once per request, not per row."""
    half = max(1, max_bytes // 2)
    if len(rows) <= FEW_ROWS:  # a small request: Python ints beat numpy's fixed cost per call (~5 us each)
        lens = rows[:, 2].tolist()
        if max(lens, default=0) <= half:  # no row to cut
            cuts, before = [], 0  # before: bytes ahead of row i
            for i in range(1, len(lens)):
                prev, before = before, before + lens[i - 1]
                if before // half != prev // half:
                    cuts.append(i)
            for a, b in zip([0, *cuts], [*cuts, len(rows)]):
                for s in range(a, b, max_rows):
                    yield rows[s:min(s + max_rows, b)]
            return
    n = rows[:, 2]
    pieces = np.maximum(1, (n + np.uint64(half - 1)) // np.uint64(half)).astype(np.int64)
    if (pieces > 1).any():  # cut long rows; pieces of one row are consecutive
        idx = np.repeat(np.arange(len(rows)), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        off = (np.arange(len(idx)) - first).astype(np.uint64) * np.uint64(half)
        rows = rows[idx].copy()
        rows[:, 0] += off
        rows[:, 1] += off
        rows[:, 2] = np.minimum(n[idx] - off, np.uint64(half))
        n = rows[:, 2]
    # every piece <= half, so a group of pieces starting below each multiple of half stays < max_bytes
    start = np.cumsum(n, dtype=np.uint64) - n
    group = (start // np.uint64(half)).astype(np.int64)
    cuts = np.flatnonzero(np.diff(group)) + 1
    for part in np.split(rows, cuts) if len(rows) else ():
        for s in range(0, len(part), max_rows):
            yield part[s:s + max_rows]
