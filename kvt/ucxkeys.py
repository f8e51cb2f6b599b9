"""UCX's packed worker addresses and remote keys, checked before UCX sees a
peer's: the nixl and ucx plugins both hand such bytes to UCX (directly, or
inside NIXL's metadata), and UCX trusts them.  A worker address in another
address-format version makes ``ucp_ep_create`` assert; a remote key whose
memory-type byte is out of range makes ``ucp_ep_rkey_unpack`` index past its
tables and segfault (a NIXL blob carrying one crashed ``add_remote_agent``).

These are envelope checks for the layouts of the UCX release kvt ships with
(>= 1.20); they refuse what UCX would misread and say nothing about whether
UCX can reach the peer.

Also where UCX listens: over its ``tcp`` transport UCX serves RMA in
software, in the target process, at whatever address the request names; no
remote key is checked.  Anyone who reaches that port (no metadata or key
needed) can read, write or crash the whole process.  So both plugins keep
UCX's network devices on loopback unless the operator names interfaces
(``UCX_NET_DEVICES``), as kvt's own listener stays on loopback unless
``listen_host`` says otherwise (docs/security.md).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping

__all__ = ["same_address_format", "is_host_rkey", "loopback_default", "cross_host_refused"]

LOOPBACK = "lo"


def loopback_default(settings: Mapping[str, str], key: str) -> bool:
    """Whether UCX's network devices are left to kvt (neither ``settings``
    nor the environment set ``UCX_NET_DEVICES``, spelled ``key`` in
    ``settings``): the caller then sets ``key`` to loopback."""
    return key not in settings and "UCX_NET_DEVICES" not in os.environ


def cross_host_refused(peer: str, option: str) -> str:
    """Why a peer on another host cannot be paired while UCX is on loopback only."""
    return (f"peer {peer!r} runs on another host, and UCX here is on loopback only (kvt's default: UCX's tcp "
            f"transport serves any address of this process to whoever reaches it, docs/security.md); name the "
            f"interfaces peers reach on both sides, on a network only they reach, e.g. {option} or "
            f"UCX_NET_DEVICES=eth0")

_HOST = 0              # UCS_MEMORY_TYPE_HOST
_NO_SYS_DEVICE = 0xFF  # UCS_SYS_DEVICE_ID_UNKNOWN: host memory has no distances packed after it


def same_address_format(address: bytes, ours: bytes) -> bool:
    """Whether a packed worker address has the address-format version of ``ours``
    (the low nibble of its first byte)."""
    return bool(address) and bool(ours) and not (address[0] ^ ours[0]) & 0x0F


def is_host_rkey(key: bytes) -> bool:
    """Whether ``key`` is laid out exactly as ``ucp_rkey_pack`` writes a host-memory
    key: an md map (u64), the memory type (host), one length-prefixed record per
    bit of the map, the system-device byte (its high bit: "flush needed"), and
    nothing after."""
    if len(key) < 9:
        return False
    (md_map,), mem_type, i = struct.unpack_from("<Q", key), key[8], 9
    if mem_type != _HOST:
        return False
    if md_map == 0:  # no memory domain can reach it (e.g. tcp only): UCX packs nothing more
        return len(key) == 9
    for _ in range(md_map.bit_count()):
        if i >= len(key):
            return False
        i += 1 + key[i]
    return i == len(key) - 1 and key[i] | 0x80 == _NO_SYS_DEVICE
