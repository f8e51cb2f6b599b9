"""Opt-in end-to-end integrity of moved blocks (``KVT_INTEGRITY=1``).

With it on, every ``Transfer.wait()`` of a block transfer that reports DONE
also proves the bytes: the side that holds the source blocks digests them,
the side they landed on digests what it has, and any difference fails the
transfer with ``IntegrityError`` instead of letting corrupted KV through.
(The connector's reads are not covered yet: its workers refuse integrity
checks on; docs/reliability.md.)  The remote side's digest travels
over the side channel (``DigestRequest``), so no backend is involved and
every backend is covered.

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

import ctypes
import os
import random

import numpy as np

from .errors import BackendUnavailable, IntegrityError, InvalidArgument, UnsupportedOperation
from .types import as_index
from .wire import BlockLayout, Message

__all__ = ["DigestRequest", "digest", "compare", "maybe_flip", "per_request", "check_request",
           "MAX_DIGEST_IDS", "MAX_DIGEST_BYTES"]

_FLIP = float(os.environ.get("KVT_INTEGRITY_TEST_FLIP") or 0)
#: most block ids one DigestRequest may name (repeats count)
MAX_DIGEST_IDS = 65_536
#: most bytes one DigestRequest may make its server hash (ids x block_len x regions; one block always may)
MAX_DIGEST_BYTES = 1 << 30
_CHUNK_BYTES = 16 << 20  # most bytes gathered at once while hashing


class DigestRequest(Message, tag="digest_req"):
    """Initiator -> the agent holding the other end: digest these blocks of a layout."""

    layout: str
    block_ids: bytes  # int64 array


def _regions(layout: BlockLayout) -> list[np.ndarray]:
    """Our own layout's regions as ``(num_blocks, block_len)`` byte arrays."""
    if layout.kind != "DRAM":
        raise UnsupportedOperation(f"integrity checks digest host memory; this layout is {layout.kind}")
    n = layout.num_blocks * layout.stride
    return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a)).reshape(layout.num_blocks, layout.stride)
            [:, :layout.block_len] for a in layout.base_addrs]


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


def digest(layout: BlockLayout, block_ids) -> np.ndarray:
    """XXH3-64 of ``block_ids`` of each region of our ``layout`` (uint64, one per region).
    Memory: one gathered chunk (``_CHUNK_BYTES``) at a time."""
    try:
        import xxhash
    except ImportError as e:
        raise BackendUnavailable("KVT_INTEGRITY needs the xxhash package: pip install 'kvt[integrity]'") from e
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


def maybe_flip(layout: BlockLayout, block_ids) -> None:
    """The test hook (see the module docstring); nothing unless it is set."""
    if _FLIP and random.random() < _FLIP:
        ids = as_index(block_ids, layout.num_blocks, "block ids")
        if ids.size:
            r = _regions(layout)[random.randrange(len(layout.base_addrs))]
            r[ids[random.randrange(ids.size)], random.randrange(layout.block_len)] ^= 0x40
