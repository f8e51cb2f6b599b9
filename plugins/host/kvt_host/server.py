"""The owner side: one thread with a ZMQ ROUTER socket that serves peers'
READ and WRITE requests and receives their notifications.

It only ever touches rows that lie wholly inside memory this agent
registered (checked before any byte moves); anything else is refused with an
``out_of_region`` reply and the server keeps serving.
"""

from __future__ import annotations

import logging

from kvt.errors import KvtError
from kvt.handshake import RouterServer
from kvt.types import Descs, MemKind
from kvt.wire import decode, encode

from .memops import gather, scatter
from .protocol import Reply, Request, rows_of

log = logging.getLogger(__name__)

class Server(RouterServer):
    def __init__(self, backend, host: str, advertise: str):
        self._b = backend
        super().__init__(self._handle, host, name="kvt-host-server", copy=False)
        self.endpoint = self.endpoint.replace(f"//{host}:", f"//{advertise}:", 1)
        self.start()

    def _handle(self, frames) -> list | None:
        try:
            req = decode(frames[0].bytes, Request)
        except KvtError as e:
            log.warning("dropping malformed request: %s", e)
            return [encode(Reply(id=-1, error=str(e), code="bad_request"))]
        if req.op == "NOTIF":
            self._b._inbox.deliver(req.sender, req.msg)
            return None
        try:
            kind = MemKind(req.kind)
            rows = rows_of(req.rows)
            if req.op not in ("READ", "WRITE"):
                raise ValueError(f"unknown op {req.op!r}")
        except ValueError as e:
            return [encode(Reply(id=req.id, error=str(e), code="bad_request"))]
        if (Descs(rows).locate(self._b._regions.of(kind)) < 0).any():
            return [encode(Reply(id=req.id, code="out_of_region",
                                 error=f"{req.sender!r} asked to {req.op} {kind.value} memory that "
                                       f"{self._b.agent_name!r} did not register"))]
        staged = kind is not MemKind.DRAM
        local = rows[:, :2].copy()
        try:
            if staged:
                local[:, 0] = self._b._mirrors.translate(rows)[0]
            if req.op == "READ":
                if staged:
                    self._b._mirrors.to_host(rows)
                return [encode(Reply(id=req.id)), gather(local)]
            if len(frames) != 2:
                raise ValueError("WRITE request without a payload frame")
            scatter(local, frames[1].buffer)
            if staged:
                self._b._mirrors.to_device(rows)
            return [encode(Reply(id=req.id))]
        except (ValueError, BufferError, OSError, KvtError) as e:
            return [encode(Reply(id=req.id, error=str(e), code="bad_request"))]
