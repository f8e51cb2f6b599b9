"""The benchmark's buffers: one arena per side, viewed as blocks of each size.

Arenas come from ``kvt.memory.empty`` (shared segments: the host backend's
fast path), and every engine gets the same kind, so no backend is measured
on friendlier memory than another.  Every page is written before timing.
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..types import Descs

__all__ = ["TARGET_FILL", "INITIATOR_FILL", "arena", "block_view", "block_rows"]

TARGET_FILL, INITIATOR_FILL = 0xA5, 0x5A


def arena(nbytes: int, fill: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` in kvt shared memory, every page written."""
    buf = memory.empty(nbytes)
    buf.fill(fill)
    return buf


def block_view(buf: np.ndarray, block: int) -> np.ndarray:
    """``buf`` as ``(n, block)`` uint8 rows (the tail that is no whole block is left out)."""
    n = buf.nbytes // block
    return buf[:n * block].reshape(n, block)


def block_rows(addr: int, nbytes: int, block: int) -> np.ndarray:
    """``(n, 3)`` uint64 descriptor rows of the whole blocks in ``[addr, addr + nbytes)``."""
    return Descs.from_blocks(addr, block, np.arange(nbytes // block)).array
