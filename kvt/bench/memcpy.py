"""Baseline: ``memcpy`` of the same blocks between two buffers of one process.

The same arenas, block size and block ids as the transfers it is compared
with; one process, so this is the machine's limit for a same-host move of
that block layout.  READ gathers the scattered "remote" blocks into the
contiguous local ones (``np.take``), WRITE scatters them back (indexed
assignment); numpy copies each block with one ``memcpy`` and no Python loop.
The copy is synchronous: a request's post time is the copy, its completion
time nil.
"""

from __future__ import annotations

import numpy as np

from ..types import Op
from .buffers import INITIATOR_FILL, TARGET_FILL, arena, block_view
from .plan import Case, Ids, Plan
from .timing import check_moves_bytes

__all__ = ["serve", "open_engine"]

serve = None  #: no target process: both buffers live in the initiator


class MemcpyEngine:
    def __init__(self, name: str, plan: Plan):
        self.name = name
        self.local, self.remote = arena(plan.arena, INITIATOR_FILL), arena(plan.arena, TARGET_FILL)
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        check_moves_bytes(self, self.local, plan.block_sizes[0])

    def _view(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if block not in self._views:
            self._views[block] = block_view(self.local, block), block_view(self.remote, block)
        return self._views[block]

    def post(self, case: Case, ids: Ids, r: int) -> None:
        local, remote = self._view(case.block)
        lo, ri = ids.local[r], ids.remote[r]
        dst = local[lo[0]:lo[-1] + 1]  # local ids are contiguous: a slice, not a copy
        if case.op is Op.READ:
            np.take(remote, ri, axis=0, out=dst, mode="clip")  # "clip": no buffered copy of out
        else:
            remote[ri] = dst

    def done(self, handle: None) -> bool:
        return True

    def release(self, handle: None) -> None:
        pass

    def close(self) -> None:
        self._views.clear()


def open_engine(spec, plan: Plan, info: None) -> MemcpyEngine:
    return MemcpyEngine(spec.name, plan)
