"""What a connector worker publishes in its ``AgentInfo.extra`` and how a
decode worker decides it can read from a prefill worker.

The check runs on the handshake thread before the peer is loaded into the
backend, and refuses with ``IncompatiblePeer`` listing every mismatch (model,
shape, dtype, block size, layout, TP), so a misconfigured deployment fails
its first request loudly instead of moving garbage.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import IncompatiblePeer
from ..wire import AgentInfo
from .config import KVCacheSpec
from .metadata import CONNECTOR_VERSION

__all__ = ["EXTRA_KEY", "WorkerCard", "check_peer"]

#: key of the connector's entry in ``AgentInfo.extra``
EXTRA_KEY = "kvt_connector"


class WorkerCard(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's identity and cache shape, as published to peers."""

    version: int = CONNECTOR_VERSION
    engine_id: str
    tp_rank: int
    tp_size: int
    spec: KVCacheSpec
    layers: list[str]  #: layer names in registration order
    parts: int         #: parts per registered buffer's block (joined K/V: 2)

    def to_extra(self) -> dict[str, Any]:
        return {EXTRA_KEY: msgspec.to_builtins(self)}

    @classmethod
    def from_info(cls, info: AgentInfo) -> "WorkerCard":
        raw = info.extra.get(EXTRA_KEY)
        if raw is None:
            raise IncompatiblePeer(f"agent {info.name!r} is not a kvt connector worker (no {EXTRA_KEY!r} "
                                   "in its handshake); point remote_endpoints at the prefill workers")
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            raise IncompatiblePeer(f"agent {info.name!r} publishes an unreadable connector card: {e}; "
                                   "run the same kvt release on both sides") from e


def _byte_order(spec: KVCacheSpec, tp_size: int) -> str:
    """The head layout a rank's blocks really have: one head per rank, one
    token per block, or MLA (no heads) lay bytes out as HND whatever the
    declared ``head_layout``."""
    if spec.mla or spec.block_size == 1 or spec.heads_per_rank(tp_size) == 1:
        return "HND"
    return spec.head_layout


def check_peer(mine: WorkerCard, theirs: WorkerCard, *, engine_id: str, rank: int, tp_size: int) -> None:
    """Refuse a peer that cannot serve our reads: ``IncompatiblePeer`` naming
    every field that differs."""
    problems = []
    if theirs.version != mine.version:
        problems.append(f"connector version {theirs.version} (ours {mine.version})")
    if theirs.engine_id != engine_id:
        problems.append(f"engine id {theirs.engine_id!r} (the request names {engine_id!r})")
    if (theirs.tp_rank, theirs.tp_size) != (rank, tp_size):
        problems.append(f"TP rank {theirs.tp_rank}/{theirs.tp_size} (expected {rank}/{tp_size})")
    a, b = mine.spec, theirs.spec
    for field in ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"):
        if getattr(a, field) != getattr(b, field):
            problems.append(f"{field} {getattr(b, field)!r} (ours {getattr(a, field)!r})")
    ours, peers = _byte_order(a, mine.tp_size), _byte_order(b, tp_size)
    if ours != peers and a.mla == b.mla:
        problems.append(f"head_layout {b.head_layout!r} (ours {a.head_layout!r})")
    if a.mla != b.mla:
        problems.append(f"kv_layout {b.kv_layout!r} (ours {a.kv_layout!r}); MLA pairs only with MLA")
    if theirs.layers != mine.layers:
        problems.append(f"layers {theirs.layers[:3]}... ({len(theirs.layers)}) differ from ours "
                        f"{mine.layers[:3]}... ({len(mine.layers)})")
    if tp_size != mine.tp_size and "NHD" in (ours, peers):
        problems.append(f"heterogeneous TP ({tp_size} -> {mine.tp_size}) slices heads inside blocks, "
                        "which needs head_layout 'HND' on both sides")
    if problems:
        raise IncompatiblePeer(f"prefill worker {theirs.engine_id!r} rank {theirs.tp_rank} cannot serve "
                               f"engine {mine.engine_id!r}: " + "; ".join(problems))
