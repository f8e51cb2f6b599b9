"""Opt-in end-to-end integrity of moved blocks (``KVT_INTEGRITY=1``).

With it on, every ``Transfer.wait()`` of a block transfer that reports DONE
also proves the bytes: the side that holds the source blocks digests them,
the side they landed on digests what it has, and any difference fails the
transfer with ``IntegrityError`` instead of letting corrupted KV through.
The connector proves its reads the same way (``verify``), on a thread of its
own, before it reports a request loaded.  The remote side's digest travels
over the side channel (``DigestRequest``), so no backend is involved and
every backend is covered.  A request may name a slice of every block
(``BlockLayout.sliced``: the heads one decode rank reads of a wider prefill
rank's blocks).

The digest is xxHash's XXH3-64 of each region's requested blocks in order,
fed to a streaming hasher in gathered chunks of at most ``_CHUNK_BYTES``
(the same value as hashing them all gathered at once, without holding them
all).  Off (the default), nothing here runs: the cost is one attribute test
per ``wait()``.  Only host (DRAM) layouts can be digested.

An agent answers ``DigestRequest`` only with integrity checks on
(``KVT_INTEGRITY=1``) and only up to ``per_request(layout)`` block ids
(``MAX_DIGEST_IDS`` ids, ``MAX_DIGEST_BYTES`` bytes hashed); the initiator
splits a bigger transfer into several requests and compares each part.

``KVT_INTEGRITY_TEST_FLIP=<probability>`` is a test hook: with that
probability a READ's landed bytes get one byte flipped before they are
checked, as a corrupting network or DMA engine would leave them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
from typing import Callable, ContextManager

import numpy as np

from .errors import (BackendUnavailable, IntegrityError, InvalidArgument, KvtError, UnsupportedOperation,
                     WireError)
from .types import as_index
from .wire import BlockLayout, Message

__all__ = ["DigestRequest", "require", "digest", "compare", "verify", "maybe_flip", "per_request",
           "check_request", "MAX_DIGEST_IDS", "MAX_DIGEST_BYTES"]

#: most block ids one DigestRequest may name (repeats count)
MAX_DIGEST_IDS = 65_536
#: most bytes one DigestRequest may make its server hash (ids x block_len x regions; one block always may)
MAX_DIGEST_BYTES = 1 << 30
_CHUNK_BYTES = 16 << 20  # most bytes gathered at once while hashing


class DigestRequest(Message, tag="digest_req"):
    """Initiator -> the agent holding the other end: digest these blocks of a layout."""

    layout: str
    block_ids: bytes  # int64 array
    # a slice of every block (BlockLayout.sliced); parts=1, offset=0, length=0: whole blocks
    parts: int = 1
    offset: int = 0
    length: int = 0

    def of(self, layout: BlockLayout) -> BlockLayout:
        """The part of ``layout`` (the server's own) this request names;
        ``InvalidArgument`` for a slice outside its blocks."""
        if (self.parts, self.offset, self.length) == (1, 0, 0):
            return layout
        try:
            return layout.sliced(self.parts, self.offset, self.length)
        except ValueError as e:
            raise InvalidArgument(f"digest request for a slice of layout {self.layout!r}: {e}") from None


def _regions(layout: BlockLayout) -> list[np.ndarray]:
    """Our own layout's regions as ``(num_blocks, block_len)`` byte arrays
    (strided views spanning exactly the blocks, so a sliced layout's last
    block ends where it does)."""
    if layout.kind != "DRAM":
        raise UnsupportedOperation(f"integrity checks digest host memory; this layout is {layout.kind}")
    span = (layout.num_blocks - 1) * layout.stride + layout.block_len if layout.num_blocks else 0
    shape, strides = (layout.num_blocks, layout.block_len), (layout.stride, 1)
    return [np.lib.stride_tricks.as_strided(np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(a)),
                                            shape, strides, writeable=True) for a in layout.base_addrs]


def per_request(layout: BlockLayout) -> int:
    """How many block ids of ``layout`` one ``DigestRequest`` may name."""
    per_block = max(1, layout.block_len * len(layout.base_addrs))
    return max(1, min(MAX_DIGEST_IDS, MAX_DIGEST_BYTES // per_block))


def check_request(layout: BlockLayout, count: int) -> None:
    """``InvalidArgument`` unless a peer may ask for a digest of ``count`` blocks of ``layout``."""
    if count > per_request(layout):
        raise InvalidArgument(f"digest request of {count} block ids; at most {per_request(layout)} per request "
                              f"for this layout (kvt.integrity.MAX_DIGEST_IDS = {MAX_DIGEST_IDS}, "
                              f"MAX_DIGEST_BYTES = {MAX_DIGEST_BYTES}): split it")


def require():
    """The hashing module; ``BackendUnavailable`` (saying what to install) without it."""
    try:
        import xxhash
    except ImportError as e:
        raise BackendUnavailable("KVT_INTEGRITY needs the xxhash package: pip install 'kvt[integrity]'") from e
    return xxhash


def digest(layout: BlockLayout, block_ids) -> np.ndarray:
    """XXH3-64 of ``block_ids`` of each region of our ``layout`` (uint64, one per region).
    Memory: one gathered chunk (``_CHUNK_BYTES``) at a time."""
    xxhash = require()
    ids = as_index(block_ids, layout.num_blocks, "block ids")
    step = max(1, _CHUNK_BYTES // max(1, layout.block_len))
    out = []
    for r in _regions(layout):
        h = xxhash.xxh3_64()
        for i in range(0, ids.size, step):
            h.update(np.ascontiguousarray(r[ids[i:i + step]]))
        out.append(h.intdigest())
    return np.array(out, np.uint64)


def compare(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    """``IntegrityError`` unless the two digests agree."""
    if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
        bad = int((mine != theirs).sum()) if mine.shape == theirs.shape else len(mine)
        raise IntegrityError(f"{what}: the bytes that arrived differ from the source's in {bad} of {len(mine)} "
                             "regions (corrupted in transit or overwritten meanwhile); the blocks are invalid, "
                             "recompute or read them again")


def verify(mine: BlockLayout, local_ids, theirs: BlockLayout, remote_ids,
           ask: Callable[[np.ndarray], np.ndarray], what: str,
           hold: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
    """Prove that ``local_ids`` of our ``mine`` hold what ``remote_ids`` of
    the peer's ``theirs`` hold: digest ours and get the peer's from
    ``ask(remote_ids_part)`` (one ``DigestRequest``), ``per_request(theirs)``
    ids at a time.  ``IntegrityError`` when they differ, and when the peer's
    cannot be had (unverified counts as failed: the checks fail closed).
    Each digest of our memory runs inside ``hold()``, which may raise a
    ``KvtError`` when that memory is going away."""
    lids = as_index(local_ids, mine.num_blocks, "block ids")
    rids = as_index(remote_ids, theirs.num_blocks, "block ids")
    step = per_request(theirs)
    ours, peers = [], []
    try:
        for i in range(0, max(lids.size, 1), step):
            with hold():
                ours.append(digest(mine, lids[i:i + step]))
            peers.append(ask(rids[i:i + step]))
            if peers[-1].shape != ours[-1].shape:  # as many digests as ours, or unreadable
                raise WireError(f"{peers[-1].nbytes} bytes of digests where {ours[-1].nbytes} were due")
    except KvtError as e:
        raise IntegrityError(f"{what} could not be verified: {type(e).__name__}: {e}") from e
    compare(np.concatenate(ours), np.concatenate(peers), what)


def maybe_flip(layout: BlockLayout, block_ids) -> None:
    """The test hook (see the module docstring); nothing unless it is set."""
    # read at each call: engines' worker processes may have imported kvt before the hook was set
    try:
        flip = float(os.environ.get("KVT_INTEGRITY_TEST_FLIP") or 0)
    except ValueError:  # not a probability: the hook stays off
        flip = 0.0
    if flip and random.random() < flip:
        ids = as_index(block_ids, layout.num_blocks, "block ids")
        if ids.size:
            r = _regions(layout)[random.randrange(len(layout.base_addrs))]
            r[ids[random.randrange(ids.size)], random.randrange(layout.block_len)] ^= 0x40
