"""The owner side: one thread with a ZMQ ROUTER socket that serves peers'
READ and WRITE requests and receives their notifications (same-host
peers' also on a Unix socket of its own: ``kvt_host.notifs``).

Every byte of a request is hostile until checked.  The server only ever
touches rows that lie wholly inside memory this agent registered (checked,
without wrapping arithmetic, before any byte moves); a request is bounded
(``MAX_REQUEST_ROWS`` rows, ``MAX_REQUEST_BYTES`` bytes, ``MAX_MESSAGE_BYTES``
per message, enforced by ZMQ before buffering); notifications are bounded in
size and in how many may wait unread.  Anything else gets a typed refusal
(``Reply.code``) and the server keeps serving.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager

from kvt.auth import Secret
from kvt.errors import AuthenticationError, InvalidDescriptor, KvtError, ServerBusy, WireError
from kvt.handshake import RouterServer
from kvt.types import Descs, MemKind
from kvt.wire import decode, encode

from .memops import gather, scatter
from .notifs import NotifListener
from .stream import StreamServer, cut
from .protocol import MAX_MESSAGE_BYTES, MAX_NAME, MAX_REQUEST_BYTES, MAX_REQUEST_ROWS, Reply, Request, rows_of

log = logging.getLogger(__name__)


class Refused(Exception):
    """A request the server will not serve; ``code`` goes back in the Reply."""

    def __init__(self, code: str, msg: str):
        super().__init__(msg)
        self.code = code


class _Use:
    """One peer request between its row check and the end of its copy."""

    __slots__ = ("kind", "rows", "sock")

    def __init__(self, sock: socket.socket | None):
        self.kind, self.rows, self.sock = None, None, sock

    def touches(self, region: Descs) -> bool:
        if self.rows is None:  # not checked yet: it may pass the check on the old table
            return True
        return self.kind is region.kind and region.overlaps(self.rows)

    def cut(self) -> None:
        if self.sock is not None:  # wakes the stream thread's send or recv at once
            cut(self.sock)


class InFlight:
    """Peer requests that passed (or are about to pass) the row check and
    have not finished copying.

    ``deregister`` must not return while one of them still copies from or
    into the memory it removes: the caller frees that memory next (a crash,
    or bytes of memory we no longer offer).  A request enters before its
    check; ``drain`` runs after the region left the table (so no new request
    passes the check), cuts the streams whose rows touch it (their peers see
    the stream close) and waits for the rest, which copy at memory speed."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._uses: set[_Use] = set()
        self._closed = False

    @contextmanager
    def use(self, sock: socket.socket | None = None):
        u = _Use(sock)
        with self._cv:
            if self._closed:  # the agent is closing: its memory may be freed as soon as close returns
                raise ConnectionError("the agent is closing")
            self._uses.add(u)
        try:
            yield u
        finally:
            with self._cv:
                self._uses.discard(u)
                self._cv.notify_all()

    def drain(self, region: Descs | None, timeout: float) -> bool:
        """False if requests still touched ``region`` (``None``: any memory)
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while busy := [u for u in self._uses if region is None or u.touches(region)]:
                for u in busy:
                    u.cut()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Admit no more requests and ``drain`` every one under way (the
        agent's ``close``: its caller may then free all it registered)."""
        with self._cv:
            self._closed = True
        return self.drain(None, timeout)


class Server(RouterServer):
    """With ``secret`` every request must be authenticated (kvt.auth); the tags
    cover the request/reply header frame (rows, sender, notification) and only
    the length of bulk payload frames (docs/security.md)."""

    def __init__(self, backend, host: str, advertise: str, secret: Secret | None = None):
        self._b, self._host = backend, host
        self._stream: StreamServer | None = None  # the tcp path's bulk bytes, opened on first use
        self.inflight = InFlight()
        super().__init__(self._handle, host, name="kvt-host-server", copy=False,
                         max_msg_bytes=MAX_MESSAGE_BYTES, refuse=self._refuse, secret=secret, covered=1)
        self.endpoint = self.endpoint.replace(f"//{host}:", f"//{advertise}:", 1)
        #: same-host peers' notifications (none with a secret: kvt_host.notifs)
        self.notifs: NotifListener | None = None
        if secret is None:
            try:
                self.notifs = NotifListener(self.watch, self._notif)
                self.tick = self.notifs.tick
            except OSError as e:  # e.g. a seccomp policy without AF_UNIX: ZMQ carries them all
                log.info("no notification socket (%s); same-host notifications go over ZMQ", e)
        self.start()

    @staticmethod
    def _refusal(rid: int, e: Exception) -> list:
        """Whatever went wrong, the initiator hears why, as a typed code."""
        code = e.code if isinstance(e, (Refused, ServerBusy)) else "unauthenticated" \
            if isinstance(e, AuthenticationError) else "bad_request"
        what = f"AuthenticationError: {e}" if isinstance(e, AuthenticationError) \
            else str(e) if isinstance(e, (Refused, KvtError)) else f"{type(e).__name__}: {e}"
        return [encode(Reply(id=rid, error=what[:1024], code=code))]

    def _refuse(self, frames, e: Exception) -> list:
        rid = -1  # not even a request id could be read
        if isinstance(e, (AuthenticationError, ServerBusy)):  # well-formed but refused: tell its sender at once
            try:
                rid = decode(frames[0].bytes, Request).id
            except (WireError, IndexError):
                pass
        return self._refusal(rid, e)

    def _handle(self, frames) -> list | None:
        req = decode(frames[0].bytes, Request)  # WireError -> refused with id -1
        if req.op == "NOTIF" and self.notifs is not None:
            # a peer's notifications on the socket, sent before this one, go first (kvt_host.notifs)
            self.notifs.drain()
        try:
            return self._serve_request(req, frames)
        except Exception as e:  # noqa: BLE001 - the server never dies and always answers
            return self._refusal(req.id, e)

    def _notif(self, frame: bytes) -> None:
        """A message on the notification socket: one NOTIF request, checked
        as one that came over ZMQ; nothing answers (as a NOTIF over ZMQ gets
        no reply), a refused one is dropped."""
        try:
            req = decode(frame, Request)
            if req.op != "NOTIF":
                raise Refused("bad_request", f"{req.op!r} request on the notification socket")
            self._serve_request(req, (frame,))
        except Exception as e:  # noqa: BLE001 - routine from a hostile peer (debug: it cannot flood the log)
            log.debug("dropped a message of the notification socket: %s: %s", type(e).__name__, e)

    def _open_stream(self, req: Request) -> list:
        if self._stream is None:
            self._stream = StreamServer(self._host, self.checked, self.inflight, self._b.timeout)
        return [encode(Reply(id=req.id, port=self._stream.port, token=self._stream.issue(req.sender)))]

    def checked(self, op: str, kind: MemKind, rows, sender: str, use: _Use):
        """The ``(k, 2)`` host rows a READ or WRITE of ``rows`` from ``sender``
        touches, once every row proved to lie in memory we registered (READ
        staged to host), and what to call once a WRITE landed.  ``Refused``
        otherwise; nothing has moved then.  Call inside ``inflight.use()``
        and copy before leaving it."""
        if not len(rows):
            raise Refused("bad_request", f"{op} request without rows")
        asked = Descs(rows)
        try:
            asked.check_rows(f"{op} request", max_rows=MAX_REQUEST_ROWS, max_bytes=MAX_REQUEST_BYTES)
        except InvalidDescriptor as e:
            raise Refused("bad_request", str(e)) from None
        use.kind, use.rows = kind, rows
        if (asked.locate(self._b._regions.of(kind)) < 0).any():
            raise Refused("out_of_region", f"{sender!r} asked to {op} {kind.value} memory that "
                                           f"{self._b.agent_name!r} did not register")
        if kind is MemKind.DRAM:
            return rows[:, :2], _nothing
        local = rows[:, :2].copy()
        local[:, 0] = self._b._mirrors.translate(rows)
        if op == "READ":
            self._b._mirrors.to_host(rows)
        return local, lambda: self._b._mirrors.to_device(rows)

    def close(self) -> None:
        super().close()
        if self.notifs is not None:
            self.notifs.close()
        if self._stream is not None:
            self._stream.close()

    def _serve_request(self, req: Request, frames) -> list | None:
        if len(req.sender) > MAX_NAME:
            raise Refused("bad_request", f"sender name longer than {MAX_NAME} characters")
        if req.op == "NOTIF":
            if len(frames) != 1:
                raise Refused("bad_request", "NOTIF request with a payload frame")
            if len(req.msg) > self._b.capabilities.max_notif_bytes:
                raise Refused("too_large", f"notification of {len(req.msg)} bytes; the limit is "
                                           f"{self._b.capabilities.max_notif_bytes}")
            if not self._b._inbox.deliver(req.sender, req.msg):
                raise Refused("busy", f"{self._b.agent_name!r} has too many unread notifications")
            return None
        if req.op == "STREAM":
            return self._open_stream(req)
        if req.op not in ("READ", "WRITE"):
            raise Refused("bad_request", f"unknown op {req.op!r}")
        try:
            kind = MemKind(req.kind)
        except ValueError:
            raise Refused("bad_request", f"unknown memory kind {req.kind!r}") from None
        with self.inflight.use() as use:
            local, landed = self.checked(req.op, kind, rows_of(req.rows), req.sender, use)
            if req.op == "READ":
                if len(frames) != 1:
                    raise Refused("bad_request", "READ request with a payload frame")
                return [encode(Reply(id=req.id)), gather(local)]
            if len(frames) != 2:
                raise Refused("bad_request", "WRITE request without exactly one payload frame")
            scatter(local, frames[1].buffer)  # BufferError if the payload does not match the rows
            landed()
        return [encode(Reply(id=req.id))]


def _nothing() -> None:
    pass
