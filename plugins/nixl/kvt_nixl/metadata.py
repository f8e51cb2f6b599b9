"""What a nixl-backend agent hands its peers: NIXL's own metadata blob,
wrapped with the agent name and the memory it registered.

NIXL's blob carries connection details and remote keys but nothing a peer
can check descriptors against before posting, so the registered regions
travel next to it: a peer validates every remote descriptor list at
``prep`` and names the first row outside.
"""

from __future__ import annotations

import os
import struct

import msgspec
import numpy as np
from kvt.epoch import EpochWatch, table, vouched_watch
from kvt.errors import WireError
from kvt.procs import host_id, start_time
from kvt.types import Descs, MemKind
from kvt.ucxkeys import is_host_rkey, same_address_format
from kvt.wire import Message, decode, encode

__all__ = ["NixlMetadata", "pack", "unpack", "vouched", "check_nixl_blob", "agent_name", "MAX_NIXL_BYTES"]

#: largest NIXL blob a peer may hand us (a few hundred bytes per registered region)
MAX_NIXL_BYTES = 16 << 20
_HEADER = b"nixlSerDes|"
_DESC_HEAD = 24  # a serialised descriptor: address, length, device id (u64 each), then the backend's blob
_DRAM = 0        # nixl_mem_t DRAM_SEG
_MAX_CONNS = 16  # connection records (one per NIXL backend plugin; there are a handful)
_MIN_SECTION = 4 * 10 + 4 + 10 + 8  # bytes at least of a memory section (bknd, nixlDList, t, n): bounds their count
#: zero bytes after every connection record's UCX worker address: ``ucp_ep_create`` takes an
#: address without its length, so a truncated one would be parsed on into whatever follows it
#: in memory (a crash that varies with the heap, which no sandbox can rule out); after the
#: padding it reads zeros, the same in the sandbox and here.  (kvt_ucx pads its copy alike.)
ADDRESS_PAD = 4096


class NixlMetadata(Message, tag="nixl_md"):
    name: str
    nixl: bytes                   # nixl_agent.get_agent_metadata()
    regions: dict[str, bytes]     # memory kind -> (n, 3) uint64 rows (address, length, device)
    # where the agent runs and its registration epoch (kvt.epoch), for same-host peers
    host_id: str = ""
    pid: int = 0
    start_time: int = 0
    epoch_fd: int = -1
    epoch: int = 0


def tables(regions: dict[MemKind, Descs]) -> dict[str, bytes]:
    """Region tables as metadata carries them."""
    return {k.value: d.array.tobytes() for k, d in regions.items()}


def pack(name: str, nixl: bytes, regions: dict[str, bytes], epoch: int, epoch_fd: int) -> bytes:
    """Our metadata: ``regions`` as ``tables`` gives them, our epoch's value and fd."""
    pid = os.getpid()
    return encode(NixlMetadata(name=name, nixl=nixl, regions=regions, host_id=host_id(), pid=pid,
                               start_time=start_time(pid), epoch_fd=epoch_fd, epoch=epoch))


def vouched(regions: dict[str, bytes], blob: bytes) -> bytes:
    """What a nixl agent vouches for on its epoch page (kvt.epoch): its
    region tables, and the connection records of its NIXL blob, which say
    what process UCX reaches (``blob`` checked: ``check_nixl_blob``)."""
    records = _records(blob, "?")
    conns = records[:records.index((b"", b"MemSection"))]  # the agent's name and its connection records
    return table(table(*(p for k in sorted(regions) for p in (k.encode(), regions[k]))), table(*(v for _, v in conns)))


def epoch_watch(md: NixlMetadata, vouch: bytes) -> EpochWatch | None:
    """A same-host peer's registration epoch, mapped, if the peer vouches
    for ``vouch`` (``unpack``'s); ``None`` for other hosts.  On this host
    UCX's cma acts on whatever memory the metadata names, in whatever
    process its addresses name: ``WireError`` if the owner does not vouch
    for it, ``PeerDisconnected`` if it names no running process."""
    if md.host_id != host_id():
        return None
    return vouched_watch(md.pid, md.start_time, md.epoch_fd, md.epoch, vouch, md.name)


class _Reader:
    """NIXL's blob read the way NIXL reads it (``nixlAgentData::loadRemoteMD``):
    each record's tag is the one NIXL expects next, not one guessed from the
    bytes, so kvt checks exactly the records NIXL will load.  ``out`` collects
    the ``(tag, value)`` records read."""

    def __init__(self, blob: bytes, name: str):
        self.blob, self.i, self.name, self.out = blob, len(_HEADER), name, []

    def bad(self, what: str) -> WireError:
        return WireError(f"NIXL metadata of {self.name!r}: {what} at byte {self.i}")

    def take(self, tag: bytes, size: int | None = None) -> bytes:
        b, i = self.blob, self.i
        j = i + len(tag) + 8
        if j > len(b) or b[i:i + len(tag)] != tag:
            raise self.bad(f"expected a {tag.decode() or 'value'!r} record")
        (n,) = struct.unpack_from("<Q", b, i + len(tag))
        if n >= len(b) - j or b[j + n] != 0x7C or (size is not None and n != size):  # then '|'
            raise self.bad(f"a malformed {tag.decode() or 'value'!r} record")
        self.out.append((tag, b[j:j + n]))
        self.i = j + n + 1
        return self.out[-1][1]

    def count(self, tag: bytes, limit: int) -> int:
        (n,) = struct.unpack("<Q", self.take(tag, 8))
        if n > limit:
            raise self.bad(f"record {tag.decode()} promises {n} entries, more than can follow")
        return n


def _parse(blob: bytes, name: str) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, int, bytes]]]:
    """The records of a NIXL blob and the ``(backend, memory type, descriptor)``
    of every descriptor in its memory sections (``WireError`` if they do not
    parse).  The grammar, in NIXL's reading order::

        Agent, Conns=C, C x (t, c), "MemSection", nixlSecElms=S,
        S x (bknd, nixlDList="nixlSDList", t (u32 memory type), n=N, N x descriptor)

    and nothing after."""
    if len(blob) > MAX_NIXL_BYTES:
        raise WireError(f"NIXL metadata of {name!r} is {len(blob)} bytes; the limit is {MAX_NIXL_BYTES}")
    if not blob.startswith(_HEADER):
        raise WireError(f"NIXL metadata of {name!r} lacks the nixlSerDes header")
    r, descs = _Reader(blob, name), []
    r.take(b"Agent")
    for _ in range(r.count(b"Conns", _MAX_CONNS)):
        r.take(b"t")
        r.take(b"c")
    if r.take(b"") != b"MemSection":
        raise r.bad("expected the memory section")
    for _ in range(r.count(b"nixlSecElms", (len(blob) - r.i) // _MIN_SECTION)):
        backend = r.take(b"bknd")
        if r.take(b"nixlDList") != b"nixlSDList":
            raise r.bad("a descriptor list of a kind NIXL does not load from peers")
        mem = int.from_bytes(r.take(b"t", 4), "little")
        for _ in range(r.count(b"n", (len(blob) - r.i) // (9 + _DESC_HEAD))):
            desc = r.take(b"")
            if len(desc) < _DESC_HEAD:
                raise r.bad("a descriptor shorter than its address, length and device")
            descs.append((backend, mem, desc))
    if r.i != len(blob):
        raise r.bad("bytes after the memory sections")
    return r.out, descs


def _records(blob: bytes, name: str) -> list[tuple[bytes, bytes]]:
    """The ``(tag, value)`` records of a NIXL blob, in order (see ``_parse``)."""
    return _parse(blob, name)[0]


def check_nixl_blob(blob: bytes, name: str, reference: bytes | None = None) -> None:
    """Structural check of NIXL's serialised agent metadata before NIXL sees
    it (NIXL's own parser trusts lengths and counts, and UCX the addresses and
    keys inside: hostile blobs crash either).

    The blob is ``nixlSerDes|`` then records ``tag, u64 length, value, '|'``,
    read in the order NIXL reads them (``_parse``): each must be the record
    NIXL expects next and fit, counts (connections, sections, descriptors)
    may not promise more than can follow, nothing may follow the memory
    sections, and the first record must name the agent ``name``.  Every
    descriptor of a UCX memory section must be DRAM with a UCX host-memory
    remote key (``kvt.ucxkeys``; kvt's nixl backend registers DRAM only).
    With ``reference`` (our own blob), each connection record's UCX address
    must carry the same address-format version as ours: UCX asserts (aborts
    the process) on any other.  ``WireError`` otherwise."""
    records, descriptors = _parse(blob, name)
    if records[0][1] != name.encode():
        raise WireError(f"NIXL metadata does not belong to agent {name!r}")
    for backend, mem, desc in descriptors:
        if backend == b"UCX" and (mem != _DRAM or not is_host_rkey(desc[_DESC_HEAD:])):
            raise WireError(f"NIXL metadata of {name!r} advertises memory whose UCX remote key is not a "
                            "host-memory key of this UCX release; run the same NIXL/UCX release on both sides")
    ours = [v for t, v in _records(reference, "self") if t == b"c" and v] if reference else []
    if ours and any(t == b"c" and not any(same_address_format(v, o) for o in ours) for t, v in records):
        raise WireError(f"NIXL metadata of {name!r} carries a transport address in a format this "
                        "UCX does not speak; run the same NIXL/UCX release on both sides")


def pad_addresses(blob: bytes) -> bytes:
    """``blob`` (checked) with ``ADDRESS_PAD`` zero bytes after each connection record's value."""
    pad = bytes(ADDRESS_PAD)
    return _blob([(t, v + pad if t == b"c" else v) for t, v in _records(blob, "?")])


def _blob(records: list[tuple[bytes, bytes]]) -> bytes:
    """A NIXL blob of ``(tag, value)`` records (the inverse of ``_records``)."""
    return _HEADER + b"".join(t + struct.pack("<Q", len(v)) + v + b"|" for t, v in records)


def agent_name(blob: bytes) -> str:
    """The agent a NIXL blob belongs to (its first record; ``WireError`` if it does not parse)."""
    return _records(blob, "?")[0][1].decode(errors="replace")


def unpack(data: bytes, reference: bytes | None = None) -> tuple[NixlMetadata, dict[MemKind, Descs], bytes]:
    """Decode a peer's metadata and its region table (``WireError`` if
    malformed), the NIXL blob checked structurally (see ``check_nixl_blob``;
    ``reference`` is our own NIXL blob) and its addresses padded
    (``pad_addresses``); with what its owner must vouch for (``vouched``)."""
    md = decode(data, NixlMetadata)
    if not 0 < len(md.name) <= 256:
        raise WireError("agent name must be 1 to 256 characters")
    check_nixl_blob(md.nixl, md.name, reference)
    vouch = vouched(md.regions, md.nixl)
    md = msgspec.structs.replace(md, nixl=pad_addresses(md.nixl))
    try:
        regions = {}
        for kind, rows in md.regions.items():
            if len(rows) % 24:
                raise ValueError(f"{len(rows)} bytes is not a whole number of (address, length, device) rows")
            regions[MemKind(kind)] = d = Descs(np.frombuffer(rows, np.uint64).reshape(-1, 3), kind)
            d.check_rows(f"{kind} regions")
    except ValueError as e:  # also an unknown memory kind
        raise WireError(f"bad region table in the nixl metadata of {md.name!r}: {e}") from e
    return md, regions, vouch
