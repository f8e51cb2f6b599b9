"""What a nixl-backend agent hands its peers: NIXL's own metadata blob,
wrapped with the agent name and the memory it registered.

NIXL's blob carries connection details and remote keys but nothing a peer
can check descriptors against before posting, so the registered regions
travel next to it: a peer validates every remote descriptor list at
``prep`` and names the first row outside.
"""

from __future__ import annotations

import numpy as np
from kvt.errors import WireError
from kvt.types import Descs, MemKind
from kvt.wire import Message, decode, encode

__all__ = ["NixlMetadata", "pack", "unpack"]


class NixlMetadata(Message, tag="nixl_md"):
    name: str
    nixl: bytes                   # nixl_agent.get_agent_metadata()
    regions: dict[str, bytes]     # memory kind -> (n, 3) uint64 rows (address, length, device)


def pack(name: str, nixl: bytes, regions: dict[MemKind, Descs]) -> bytes:
    return encode(NixlMetadata(name=name, nixl=nixl,
                               regions={k.value: d.array.tobytes() for k, d in regions.items()}))


def unpack(data: bytes) -> tuple[NixlMetadata, dict[MemKind, Descs]]:
    """Decode a peer's metadata and its region table (``WireError`` if malformed)."""
    md = decode(data, NixlMetadata)
    try:
        regions = {}
        for kind, rows in md.regions.items():
            if len(rows) % 24:
                raise ValueError(f"{len(rows)} bytes is not a whole number of (address, length, device) rows")
            regions[MemKind(kind)] = Descs(np.frombuffer(rows, np.uint64).reshape(-1, 3), kind)
    except ValueError as e:  # also an unknown memory kind
        raise WireError(f"bad region table in the nixl metadata of {md.name!r}: {e}") from e
    return md, regions
