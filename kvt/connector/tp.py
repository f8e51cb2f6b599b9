"""Heterogeneous tensor parallelism: which prefill ranks a decode rank reads,
and which bytes of each block.

Every block of every layer is seen as *parts* — K and V (or the one MLA
latent) — each ``part_len`` bytes with heads outermost (HND), so a slice of
heads is one contiguous byte range of a part:

* decode TP = k x prefill TP: decode rank ``r`` reads heads slice ``r % k``
  (of ``k``) of every part of prefill rank ``r // k`` into its whole parts;
* prefill TP = k x decode TP: decode rank ``r`` reads the whole parts of
  prefill ranks ``r*k .. r*k+k-1``, each into slice ``i`` of its own parts;
* replicated KV (MLA): whole parts from one rank; when prefill TP is larger,
  the other ranks of the group only get a notification.

Descriptor lists are built with numpy broadcasts (``BlockLayout.descs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import IncompatiblePeer
from ..wire import BlockLayout
from .config import KVCacheSpec

__all__ = ["Slice", "Read", "ReadPlan", "remote_ranks", "plan_reads", "readers_per_rank",
           "part_layout", "tp_problem"]


@dataclass(frozen=True)
class Slice:
    """Bytes ``[offset, offset + length)`` of every part of every block."""

    offset: int
    length: int


@dataclass(frozen=True)
class Read:
    remote_rank: int
    local: Slice
    remote: Slice


@dataclass(frozen=True)
class ReadPlan:
    reads: tuple[Read, ...]
    notify_only: tuple[int, ...] = ()  #: ranks told "done" without a read (replicated KV)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r.remote_rank for r in self.reads) + self.notify_only


def tp_problem(kv: KVCacheSpec, prefill_tp: int, decode_tp: int) -> str | None:
    """Why a prefill engine of ``prefill_tp`` ranks cannot serve us, as far
    as the numbers alone tell (before any handshake), or None."""
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if big % small:
        return (f"tensor-parallel sizes {prefill_tp} (prefill) and {decode_tp} (decode) do not divide; "
                "heterogeneous TP needs one to be a multiple of the other")
    if not kv.mla and kv.num_kv_heads % prefill_tp:
        return (f"a prefill engine of tp_size {prefill_tp} cannot split the model's {kv.num_kv_heads} KV heads "
                "evenly: the kv_transfer_params name another model or a wrong tp_size")
    return None


def _ratio(big: int, small: int) -> int:
    if big % small:
        raise IncompatiblePeer(f"tensor-parallel sizes {big} and {small} do not divide; heterogeneous TP "
                               "needs one to be a multiple of the other")
    return big // small


def remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The prefill ranks decode rank ``local_rank`` talks to."""
    if local_tp >= remote_tp:
        return [local_rank // _ratio(local_tp, remote_tp)]
    k = _ratio(remote_tp, local_tp)
    return list(range(local_rank * k, local_rank * k + k))


def readers_per_rank(producer_tp: int, consumer_tp: int) -> int:
    """How many decode ranks finish with each prefill rank's blocks."""
    return max(1, consumer_tp // producer_tp)


def plan_reads(local_rank: int, local_tp: int, remote_tp: int, local_part: int, remote_part: int,
               replicated: bool) -> ReadPlan:
    """The reads decode rank ``local_rank`` issues; ``IncompatiblePeer`` when
    the part sizes do not fit the TP ratio (different model or dtype)."""
    ranks = remote_ranks(local_rank, local_tp, remote_tp)
    whole_l, whole_r = Slice(0, local_part), Slice(0, remote_part)
    if replicated:
        if local_part != remote_part:
            raise IncompatiblePeer(f"replicated (MLA) blocks differ: {local_part} B per part here, "
                                   f"{remote_part} B at the peer")
        return ReadPlan((Read(ranks[0], whole_l, whole_r),), tuple(ranks[1:]))
    if local_tp >= remote_tp:
        k = local_tp // remote_tp
        if remote_part != local_part * k:
            raise IncompatiblePeer(f"with decode TP {local_tp} and prefill TP {remote_tp} a prefill part must "
                                   f"be {k} x {local_part} B, the peer's is {remote_part} B")
        return ReadPlan((Read(ranks[0], whole_l, Slice((local_rank % k) * local_part, local_part)),))
    k = remote_tp // local_tp
    if local_part != remote_part * k:
        raise IncompatiblePeer(f"with decode TP {local_tp} and prefill TP {remote_tp} a decode part must "
                               f"be {k} x {remote_part} B, ours is {local_part} B")
    return ReadPlan(tuple(Read(rank, Slice(i * remote_part, remote_part), whole_r) for i, rank in enumerate(ranks)))


def part_layout(layout: BlockLayout, parts: int, sl: Slice) -> BlockLayout:
    """The layout whose block ``b`` of region ``i`` is slice ``sl`` of part
    ``i % parts`` of block ``b`` of buffer ``i // parts`` in ``layout``."""
    return layout.sliced(parts, sl.offset, sl.length)
