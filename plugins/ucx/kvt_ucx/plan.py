"""How a transfer's blocks become UCX messages, and the copies in and out of
staging buffers.  All vectorised: a 100,000-block batch is a few numpy calls.

A transfer pairs local rows with remote rows.  Pairs contiguous on both sides
merge into *runs*.  A run of at least ``zcopy_min`` bytes (and every run of
device memory) travels as its own tag message, straight from the sender's
memory into the receiver's.  Smaller runs are packed into *staged* messages of
about ``stage_max`` bytes: the sender gathers them into one buffer, the
receiver scatters them out, so 4096 small blocks cost a handful of messages,
not 4096.

The initiator plans; the target just follows the plan it is sent: the run
list (in message order) and the message boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .native import host_view

__all__ = ["Plan", "make_plan", "gather", "scatter"]


@dataclass(frozen=True)
class Plan:
    """Runs in message order and how they split into messages.

    ``local`` is ``(k, 2)`` (address, length) in our memory, ``remote`` is
    ``(k, 3)`` (address, length, device) in the peer's.  Message ``j`` covers
    runs ``bounds[j]:bounds[j+1]``; ``staged[j]`` says whether it goes
    through a staging buffer (else it is exactly one run, sent in place).
    """

    local: np.ndarray
    remote: np.ndarray
    bounds: np.ndarray
    staged: np.ndarray

    @property
    def messages(self) -> int:
        return len(self.staged)

    def sizes(self) -> np.ndarray:
        """Bytes per message."""
        ends = np.concatenate((np.zeros(1, np.uint64), np.cumsum(self.local[:, 1], dtype=np.uint64)))
        return ends[self.bounds[1:]] - ends[self.bounds[:-1]]


def _merge(lrows: np.ndarray, rrows: np.ndarray, rregion: np.ndarray):
    """Merge consecutive pairs that continue each other on both sides (and
    stay inside one remote registration, which the target checks run by run)."""
    lens = lrows[:, 1]
    if len(lens) < 2:
        return lrows[:, 0], rrows, lens
    goes_on = ((lrows[:-1, 0] + lens[:-1] == lrows[1:, 0]) & (rrows[:-1, 0] + lens[:-1] == rrows[1:, 0])
               & (rregion[:-1] == rregion[1:]))
    heads = np.flatnonzero(np.concatenate(([True], ~goes_on)))
    merged = np.add.reduceat(lens, heads)
    remote = rrows[heads]
    remote[:, 1] = merged
    return lrows[heads, 0], remote, merged


def make_plan(lrows: np.ndarray, rrows: np.ndarray, rregion: np.ndarray, *, sender_is_local: bool,
              zcopy_min: int, stage_max: int, in_place_only: bool = False) -> Plan:
    """Plan the messages for paired rows (``(k, 3)`` each, equal lengths).

    ``rregion`` is the remote registration index of each remote row.
    Staged runs are ordered by the *sender's* (length, address mod length) so
    its gather is a few ``np.take`` calls.  ``in_place_only`` (device memory)
    sends every run as its own message.
    """
    keep = lrows[:, 1] > 0
    laddr, remote, lens = _merge(lrows[keep], rrows[keep], rregion[keep])
    big = np.ones(len(lens), bool) if in_place_only else lens >= zcopy_min
    small = np.flatnonzero(~big)
    sender = (laddr if sender_is_local else remote[:, 0])[small]
    slen = lens[small]
    small = small[np.lexsort((sender % slen, slen))]
    # chunk by running offset: each staged message holds about stage_max bytes
    starts = np.cumsum(lens[small], dtype=np.uint64) - lens[small]
    chunk = starts // np.uint64(max(stage_max, 1))
    cuts = np.flatnonzero(np.diff(chunk)) + 1
    order = np.concatenate((small, np.flatnonzero(big)))
    n_small, n_big = len(small), int(big.sum())
    bounds = np.concatenate(([0], cuts, [n_small] if n_small else [], n_small + np.arange(1, n_big + 1)))
    staged = np.concatenate((np.ones(len(cuts) + bool(n_small), bool), np.zeros(n_big, bool)))
    local = np.stack((laddr[order], lens[order]), axis=1)
    return Plan(local=np.ascontiguousarray(local, np.uint64), remote=np.ascontiguousarray(remote[order], np.uint64),
                bounds=bounds.astype(np.int64), staged=staged)


def _stretches(rows: np.ndarray, by_residue: bool):
    """Maximal stretches of rows with equal length (and equal address modulo
    the length, if ``by_residue``): ``(addresses, length, lo, hi)`` where
    ``lo:hi`` is the stretch's place in the packed buffer."""
    addrs, lens = rows[:, 0], rows[:, 1]
    change = lens[1:] != lens[:-1]
    if by_residue:
        change |= (addrs[1:] % lens[1:]) != (addrs[:-1] % lens[:-1])
    starts = np.flatnonzero(np.concatenate(([True], change))).tolist()
    offs = np.concatenate(([0], np.cumsum(lens, dtype=np.uint64))).astype(np.int64)
    for s, e in zip(starts, starts[1:] + [len(lens)]):
        yield addrs[s:e], int(lens[s]), int(offs[s]), int(offs[e])


def gather(rows: np.ndarray, out: np.ndarray) -> None:
    """Copy the ``(address, length)`` rows, in order, into contiguous ``out``.

    Rows of one length whose addresses agree modulo that length are rows of
    one C-contiguous ``(n, length)`` view, so each such stretch is a single
    ``np.take`` (memcpy per row, no per-row Python)."""
    for a, size, lo, hi in _stretches(rows, by_residue=True):
        base = int(a.min())
        idx = ((a - np.uint64(base)) // np.uint64(size)).astype(np.intp)
        src = host_view(base, (int(idx.max()) + 1, size))
        np.take(src, idx, axis=0, out=out[lo:hi].reshape(-1, size), mode="clip")


def scatter(rows: np.ndarray, buf: np.ndarray) -> None:
    """Copy contiguous ``buf`` out into the ``(address, length)`` rows, in order.

    A stretch of rows of one length is one fancy assignment into a view whose
    items are ``length``-byte records starting at every byte, so any
    addresses work."""
    for a, size, lo, hi in _stretches(rows, by_residue=False):
        base = int(a.min())
        dst = host_view(base, int(a.max()) - base + 1, f"V{size}", (1,))
        dst[(a - np.uint64(base)).astype(np.intp)] = buf[lo:hi].view(f"V{size}")
