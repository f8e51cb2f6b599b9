"""The timed loop every engine runs through, so that all are measured alike.

An *engine* is the initiator side of one thing under test (a kvt backend,
raw NIXL, memcpy).  It posts one request of a case and polls it::

    h = engine.post(case, ids, r)   # returns at once (memcpy: after copying)
    engine.done(h)                  # True when complete; raises TransferError on failure
    engine.release(h)
    engine.close()

One iteration posts ``case.inflight`` requests back to back, then polls them
all until done.  Its *post* time is the posting, its *completion* time the
polling that follows; latency is the sum.  Its *CPU* time is what the
initiator process (every thread) used meanwhile, per request.  Polling spins but yields the GIL
between polls (``time.sleep(0)``), so backends that complete transfers on
their own threads are not starved by the waiting thread.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from ..errors import KvtError, KvtTimeoutError, TransferError
from ..types import Op
from .buffers import TARGET_FILL
from .plan import Case, Ids, Plan
from .stats import failed, summarize

__all__ = ["Engine", "measure", "check_moves_bytes"]


class Engine(Protocol):
    name: str

    def post(self, case: Case, ids: Ids, r: int) -> Any: ...

    def done(self, handle: Any) -> bool: ...

    def release(self, handle: Any) -> None: ...

    def close(self) -> None: ...


def _iteration(engine: Engine, case: Case, ids: Ids, timeout: float) -> tuple[float, float, float]:
    handles: list[Any] = []
    try:
        c0 = time.process_time()
        t0 = time.perf_counter()
        for r in range(case.inflight):
            handles.append(engine.post(case, ids, r))
        t1 = time.perf_counter()
        deadline = t1 + timeout
        pending = list(handles)
        while pending:
            pending = [h for h in pending if not engine.done(h)]
            if pending:
                if time.perf_counter() > deadline:
                    raise KvtTimeoutError(f"{len(pending)} of {case.inflight} requests not done "
                                          f"within {timeout:g}s")
                time.sleep(0)
        t2 = time.perf_counter()
        cpu = (time.process_time() - c0) / case.inflight
    finally:
        for h in handles:
            engine.release(h)
    return t1 - t0, t2 - t1, cpu


def measure(engine: Engine, case: Case, plan: Plan) -> dict:
    """Warm up, then time iterations until the budget is spent (at least
    ``min_iters``, at most ``max_iters``).  A failing case gives a row with
    its ``error`` instead of raising.  A cold plan's iterations cycle through
    the case's rotations, each touched once while warming up (so page
    faults of first use are not timed: an engine's mappings are warm too)."""
    base, n, pool = case.ids(), plan.rotations(case), case.batch * case.inflight
    post, done, cpu = [], [], []
    try:
        for i in range(plan.warmup if n == 1 else max(plan.warmup, n)):
            _iteration(engine, case, base.shifted(i % n * pool), plan.timeout)
        start = time.perf_counter()
        while len(post) < plan.min_iters or (time.perf_counter() - start < plan.budget
                                             and len(post) < plan.max_iters):
            p, c, u = _iteration(engine, case, base.shifted(len(post) % n * pool), plan.timeout)
            post.append(p)
            done.append(c)
            cpu.append(u)
    except KvtError as e:
        return failed(engine.name, case, f"{type(e).__name__}: {e}")
    return summarize(engine.name, case, post, done, cpu)


def check_moves_bytes(engine: Engine, local: np.ndarray, block: int) -> None:
    """READ one block and check it holds the target's fill: proof that the
    engine really moves bytes between the two buffers before anything is timed."""
    case = Case("check", Op.READ, block, 1)
    local[:block] = 0
    _iteration(engine, case, case.ids(), 60.0)
    if not (local[:block] == TARGET_FILL).all():
        raise TransferError(f"{engine.name}: a READ completed but the block does not hold the target's bytes")
