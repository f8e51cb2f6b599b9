"""Baseline: the same transfers written directly against ``nixl_agent``.

What an engine that calls NIXL itself does (vLLM's NixlConnector pattern):
register the arena once, prep one descriptor list per block size for each
side, then ``make_prepped_xfer`` + ``transfer`` per request and
``check_xfer_state`` until done.  NIXL's defaults (UCX backend, progress
thread), except that the nixl backend's ``progress_thread`` and ``ucx_env``
options, when configured, apply here too: the two stay comparable.  Runs in
processes of its own: nixl bundles a libucx that must not meet ucxx's in one
process.  NIXL's native errors become ``TransferError``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..errors import BackendUnavailable, TransferError
from .buffers import INITIATOR_FILL, TARGET_FILL, arena, block_rows
from .plan import Case, Ids, Plan
from .timing import check_moves_bytes

__all__ = ["serve", "open_engine"]


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixlBind
    except ImportError as e:
        raise BackendUnavailable(f"the nixl package is not importable: {e}") from e
    errors = tuple(v for k, v in vars(nixlBind).items()
                   if k.startswith("nixl") and isinstance(v, type) and issubclass(v, Exception))
    return nixl_agent, nixl_agent_config, errors


class _Side:
    """A nixl agent with the arena registered."""

    def __init__(self, spec, role: str, plan: Plan, fill: int):
        nixl_agent, nixl_agent_config, self.errors = _nixl()
        options = spec.config.options if spec.config else {}
        # this process exists for this agent alone: UCX reads its settings from the environment
        os.environ.update({k: str(v) for k, v in options.get("ucx_env", {}).items()})
        conf = nixl_agent_config(enable_prog_thread=bool(options.get("progress_thread", True)), backends=["UCX"])
        self.buf = arena(plan.arena, fill)
        try:
            self.agent = nixl_agent(f"bench-raw-{role}", conf)
            self.reg = self.agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")
        except self.errors as e:
            raise BackendUnavailable(f"nixl agent could not start: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def serve(spec, plan: Plan, ready: Callable[[object], None],
          serve_until_stopped: Callable[[Callable[[], object]], None]) -> None:
    side = _Side(spec, "target", plan, TARGET_FILL)
    try:
        ready((side.agent.get_agent_metadata(), side.buf.ctypes.data))
        serve_until_stopped(side.agent.get_new_notifs)
    finally:
        side.close()


class RawNixlEngine:
    def __init__(self, spec, plan: Plan, info: tuple[bytes, int]):
        self.name = spec.name
        metadata, remote_addr = info
        self.side = side = _Side(spec, "initiator", plan, INITIATOR_FILL)
        a, n = side.agent, side.buf.nbytes
        try:
            self.peer = a.add_remote_agent(metadata)
            self.local = {b: a.prep_xfer_dlist("NIXL_INIT_AGENT", block_rows(side.buf.ctypes.data, n, b), "DRAM")
                          for b in plan.block_sizes}
            self.remote = {b: a.prep_xfer_dlist(self.peer, block_rows(remote_addr, n, b), "DRAM")
                           for b in plan.block_sizes}
        except side.errors as e:
            raise TransferError(f"nixl could not prepare the transfers: {type(e).__name__}: {e}") from e
        check_moves_bytes(self, side.buf, plan.block_sizes[0])

    def post(self, case: Case, ids: Ids, r: int) -> list[Any]:
        a = self.side.agent
        try:
            h = a.make_prepped_xfer(case.op.value, self.local[case.block], ids.local[r],
                                    self.remote[case.block], ids.remote[r])
            state = a.transfer(h)
        except self.side.errors as e:
            raise TransferError(f"nixl {case.op.value} failed to post: {type(e).__name__}: {e}") from e
        return [h, state]

    def done(self, x: list[Any]) -> bool:
        if x[1] == "PROC":
            try:
                x[1] = self.side.agent.check_xfer_state(x[0])
            except self.side.errors as e:
                raise TransferError(f"nixl transfer failed: {type(e).__name__}: {e}") from e
        if x[1] == "ERR":
            raise TransferError("nixl reported ERR for the transfer")
        return x[1] == "DONE"

    def release(self, x: list[Any]) -> None:
        try:
            self.side.agent.release_xfer_handle(x[0])
        except self.side.errors as e:
            raise TransferError(f"nixl could not release a transfer: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        for h in [*self.local.values(), *self.remote.values()]:
            self.side.agent.release_dlist_handle(h)
        self.side.agent.remove_remote_agent(self.peer)
        self.side.close()


def open_engine(spec, plan: Plan, info: tuple[bytes, int]) -> RawNixlEngine:
    return RawNixlEngine(spec, plan, info)
