"""A kvt backend under test, driven through ``kvt.Agent`` as an engine would.

Each side registers its arena once per block size of the plan (one block
layout each, all over the same memory: the protocol allows overlapping
registrations), the initiator connects through the handshake side channel,
and requests are ``Agent.transfer_blocks`` calls: what a connector does.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..agent import Agent, Transfer
from ..errors import BackendUnavailable
from .buffers import INITIATOR_FILL, TARGET_FILL, arena, block_view
from .plan import Case, Ids, Plan
from .timing import check_moves_bytes

__all__ = ["serve", "open_engine", "layout_name"]


def layout_name(block: int) -> str:
    return f"bench-{block}"


def _agent(spec, plan: Plan, role: str, fill: int) -> tuple[Agent, np.ndarray]:
    agent = Agent(name=f"bench-{role}", config=spec.config)
    try:
        if not agent.backend.capabilities.remote:
            raise BackendUnavailable(f"backend {spec.config.backend!r} declares remote=False; "
                                     "kvt bench measures transfers between two processes")
        buf = arena(plan.arena, fill)
        for block in plan.block_sizes:
            agent.register_blocks(layout_name(block), [block_view(buf, block)])
    except BaseException:
        agent.close()
        raise
    return agent, buf


def serve(spec, plan: Plan, ready: Callable[[object], None],
          serve_until_stopped: Callable[[Callable[[], object]], None]) -> None:
    """The target: register, publish the handshake endpoint, poll notifications until told to stop."""
    agent, _buf = _agent(spec, plan, "target", TARGET_FILL)
    with agent:
        ready(agent.listen())
        serve_until_stopped(agent.get_notifs)


class AgentEngine:
    def __init__(self, spec, plan: Plan, endpoint: str):
        self.name = spec.name
        self.agent, self.buf = _agent(spec, plan, "initiator", INITIATOR_FILL)
        try:
            self.peer = self.agent.connect(endpoint)
            check_moves_bytes(self, self.buf, plan.block_sizes[0])
        except BaseException:
            self.agent.close()
            raise

    def post(self, case: Case, ids: Ids, r: int) -> Transfer:
        return self.agent.transfer_blocks(case.op, self.peer, ids.local[r], ids.remote[r], layout_name(case.block))

    def done(self, x: Transfer) -> bool:
        state = x.state()
        if state.failed:
            raise state.cause
        return state.done

    def release(self, x: Transfer) -> None:
        x.release()

    def close(self) -> None:
        self.agent.close()


def open_engine(spec, plan: Plan, endpoint: str) -> AgentEngine:
    return AgentEngine(spec, plan, endpoint)
