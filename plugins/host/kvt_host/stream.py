"""The tcp path's bulk bytes: a plain TCP stream per peer, next to the ZMQ channel.

Over ZMQ every request's bytes were gathered into a message, copied by ZMQ
on both sides and scattered again (0.37x a plain socket stream at 256 MiB).
Here the bytes go from the source rows to the socket and from the socket into
the destination rows: large rows straight from and into memory
(``sendall``/``recv_into`` on views of the rows), small ones through one
staging buffer per request (one native gather or scatter), so a request of
many 4 KiB blocks is still a few system calls.

Setting up: the initiator asks the owner's server (``Request(op="STREAM")``
on the ZMQ channel, authenticated there when ``auth_key`` is set) for a
one-time token and a port, connects, and sends the token; the owner binds the
connection to that peer and answers one byte, 1 (served) or 0 (all its
stream slots are taken: the initiator sends that request's bytes in ZMQ
messages instead).  Unknown, reused or late tokens get the connection
closed.  A connection has ``_HELLO_TIMEOUT`` seconds in all to present its
token, and at most ``_MAX_HELLOS`` may be presenting at once, apart from the
``_MAX_CONNECTIONS`` being served: a flood of idle connections can delay
peers' streams, never take their slots.  A served stream that sends no
request for ``_IDLE`` seconds is closed, so idle streams give their slots
back; initiators reopen theirs once idle for a third of that, so an honest
stream is never closed under a request.  Then, per request (little-endian)::

    initiator -> owner   "kvtS" op:u8 kind:u8 0:u16 rows:u32 | rows x (addr, len, dev):u64 | WRITE: payload
                         (up to _AHEAD more requests may follow before the first answer is read)
    owner -> initiator   code:u8 0:u8 text_len:u16 | text | READ and code 0: payload

The owner checks the rows exactly as its ZMQ server does (``Server.checked``)
before any byte moves; a refused WRITE's payload is read and dropped, so the
stream stays in step.  From its check to the end of its copy a request is in
the server's ``InFlight`` set: ``deregister`` cuts the connection of one that
touches the memory it removes (the bytes move straight from and into that
memory).  Each connection has its own thread at the owner and a socket
timeout: a peer that stalls, lies about lengths or disconnects loses its own
connection, nothing else.  The initiator gives each ``move`` one deadline
(``timeout``) and ``abort()`` cuts a move short: once either ends it, no
more bytes land in its memory.
"""

from __future__ import annotations

import ctypes
import logging
import secrets
import socket
import struct
import threading
import time

import numpy as np
from kvt.errors import PeerDisconnected, RemoteRejected, TransferTimeout
from kvt.types import MemKind

from .memops import gather, scatter
from .protocol import FEW_ROWS, MAX_REQUEST_BYTES, MAX_REQUEST_ROWS

log = logging.getLogger(__name__)

__all__ = ["StreamServer", "Stream", "cut"]

_HEAD = struct.Struct("<4sBBHI")
_REPLY = struct.Struct("<BBH")
_TIMEVAL = struct.Struct("@ll")  # struct timeval (SO_RCVTIMEO)
_MAGIC = b"kvtS"
_OPS = {"READ": 1, "WRITE": 2}
_KINDS = list(MemKind)
_CODES = ["", "bad_request", "out_of_region", "busy"]
_TOKEN = 16
_TOKEN_TTL = 30.0           # seconds a token may wait for its connection
_MAX_TOKENS = 256           # tokens outstanding at once
_MAX_CONNECTIONS = 64       # stream connections an owner serves at once
_MAX_HELLOS = 64            # connections presenting their token at once (not yet counted above)
_HELLO_TIMEOUT = 5.0        # seconds a new connection has, in all, to present its token
_IDLE = 60.0                # seconds a served stream may wait for its next request
_AHEAD = 2                  # requests an initiator sends before reading the first one's answer
_DIRECT = 256 << 10         # rows at least this long move straight from/to memory
_PIECE = 1 << 20            # shorter ones are staged (gathered or scattered) this many bytes at a time



def _tune(sock: socket.socket) -> None:
    # no SO_SNDBUF/SO_RCVBUF: fixing them turns off the kernel's autotuning, which measured as fast or faster
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def cut(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways: a thread blocked in its send or recv wakes at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; ``socket.timeout`` (what a recv or send
    that timed out raises, and callers map) once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    return left


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; with a ``deadline`` (monotonic) the whole of it must
    arrive by then (socket.timeout), however the peer trickles it."""
    got, n = 0, len(view)
    if n >= _DIRECT and deadline is not None:
        _recv_waitall(sock, view, deadline)
        return
    while got < n:
        if deadline is not None:
            # checked before each recv, not just handed to it: a peer sending a byte before each
            # recv's timeout would otherwise keep the loop going past the deadline for good
            sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the other side closed the stream")
        got += k


def _recv_waitall(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """``_recv_exact`` of a large view: the socket blocking, with MSG_WAITALL
    and the time left as its receive timeout, so the kernel fills the view in
    one call.  A socket with a timeout polls before every recv, and a
    receiver that keeps up wakes for every few hundred KiB: two system calls
    and a pass through Python each time, thousands per 256 MiB."""
    got, n, before = 0, len(view), sock.gettimeout()
    sock.settimeout(None)
    try:
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            sec = int(left)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(sec, int((left - sec) * 1e6) or 1))
            try:
                k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)  # returns early on timeout, EOF, a cut
            except BlockingIOError:  # the receive timeout passed with nothing received
                raise socket.timeout("timed out") from None
            if not k:
                raise ConnectionError("the other side closed the stream")
            got += k
    finally:
        sock.settimeout(before)


def _recv_bytes(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def _send_all(sock: socket.socket, data, deadline: float | None) -> None:
    if deadline is not None:  # sendall's timeout bounds the whole call; a call made past it sends nothing
        sock.settimeout(_left(deadline))
    sock.sendall(data)


def _runs(rows: np.ndarray) -> list[tuple[bool, np.ndarray, int]]:
    """``rows`` in order as ``(direct, rows, bytes)`` runs: each row of at
    least ``_DIRECT`` bytes alone, the short ones between them in runs of
    under ``_PIECE + _DIRECT`` bytes.  A run of several rows is staged
    (gathered or scattered through one buffer: one system call for many
    rows); a run of one row moves straight from or into memory (``direct``:
    a copy of one row would save nothing).  Staging a piece at a time
    bounds what a request holds: an owner's READ reply to a peer that stops
    reading pins one piece, not the request's 32 MiB (times 64 streams)."""
    if not len(rows):
        return []
    if len(rows) <= FEW_ROWS:  # a small request: Python ints beat numpy's fixed cost per call
        lens = rows[:, 1].tolist()
        starts, before = [0], 0  # before: bytes of the short rows ahead of row i
        for i in range(1, len(lens)):
            prev, last_big = before, lens[i - 1] >= _DIRECT
            before += 0 if last_big else lens[i - 1]
            if last_big or lens[i] >= _DIRECT or before // _PIECE != prev // _PIECE:
                starts.append(i)
        ends = [*starts[1:], len(lens)]
        return [(j - i == 1, rows[i:j], sum(lens[i:j])) for i, j in zip(starts, ends)]
    lens = rows[:, 1]
    big = lens >= _DIRECT
    small = np.where(big, 0, lens)
    key = np.where(big, -1, ((np.cumsum(small) - small) // _PIECE).astype(np.int64))
    starts = np.concatenate([[0], np.flatnonzero((key[1:] != key[:-1]) | big[1:] | big[:-1]) + 1])
    sizes = np.add.reduceat(lens, starts).tolist()
    bounds = starts.tolist()
    return [(j - i == 1, rows[i:j], n) for i, j, n in zip(bounds, [*bounds[1:], len(rows)], sizes)]


def _staging(runs: list[tuple[bool, np.ndarray, int]]) -> np.ndarray | None:
    most = max((n for direct, _, n in runs if not direct), default=0)
    return np.empty(most, np.uint8) if most else None


def send_rows(sock: socket.socket, rows: np.ndarray, deadline: float | None = None) -> None:
    """The bytes of ``(k, 2)`` (address, length) rows, in order."""
    runs = _runs(rows)
    buf = _staging(runs)
    for direct, run, n in runs:
        if direct:
            _send_all(sock, _view(int(run[0, 0]), n), deadline)
        else:
            _send_all(sock, gather(run, buf), deadline)


def recv_rows(sock: socket.socket, rows: np.ndarray, deadline: float | None = None) -> None:
    """Fill ``(k, 2)`` (address, length) rows from the stream, in order."""
    runs = _runs(rows)
    buf = _staging(runs)
    for direct, run, n in runs:
        if direct:
            _recv_exact(sock, _view(int(run[0, 0]), n), deadline)
        else:
            piece = buf[:n]
            _recv_exact(sock, memoryview(piece), deadline)
            scatter(run, piece)


def _discard(sock: socket.socket, n: int, deadline: float) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        sock.settimeout(_left(deadline))  # (as in _recv_exact: a trickle cannot outlast the deadline)
        k = sock.recv_into(scratch[:min(n, len(scratch))])
        if not k:
            raise ConnectionError("the other side closed the stream")
        n -= k


class StreamServer:
    """The owner side: a listening socket, the tokens handed out, a thread per connection.

    ``check(op, kind, rows, sender, use)`` is the ZMQ server's own check: it
    returns the ``(k, 2)`` host rows to copy from or into and a ``done()`` to
    call after a WRITE landed (device staging), or raises ``Refused``;
    ``inflight`` is the server's ``InFlight``, entered around check and copy."""

    def __init__(self, host: str, check, inflight, timeout: float):
        self._check, self._inflight, self._timeout = check, inflight, timeout
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self._tokens: dict[bytes, tuple[str, float]] = {}
        self._conns: set[socket.socket] = set()  # being served
        self._hellos = 0                         # connections still presenting their token
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"kvt-host-stream:{self.port}", daemon=True).start()

    def issue(self, sender: str) -> bytes:
        """A one-time token for ``sender``'s next connection."""
        now = time.monotonic()
        with self._lock:
            for t in [t for t, (_, until) in self._tokens.items() if until < now]:
                del self._tokens[t]
            if len(self._tokens) >= _MAX_TOKENS:
                raise ValueError("too many stream connections being set up")
            token = secrets.token_bytes(_TOKEN)
            self._tokens[token] = (sender, now + _TOKEN_TTL)
        return token

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = self._hellos >= _MAX_HELLOS
                self._hellos += not full
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"kvt-host-stream:{self.port}",
                             daemon=True).start()

    def _hello(self, conn: socket.socket) -> str:
        """The sender a new connection's token was issued to, once it has a
        slot ("" to hang up); the initiator hears 1 (served) or 0 (slots full)."""
        try:
            token = _recv_bytes(conn, _TOKEN, time.monotonic() + min(self._timeout, _HELLO_TIMEOUT))
        finally:
            with self._lock:
                self._hellos -= 1
        with self._lock:
            sender, until = self._tokens.pop(token, ("", 0.0))
            if not sender or until < time.monotonic():
                return ""  # unknown, reused or late: nothing more for this connection
            served = len(self._conns) < _MAX_CONNECTIONS and not self._closed
            if served:
                self._conns.add(conn)
        conn.sendall(b"\x01" if served else b"\x00")
        return sender if served else ""

    def _serve(self, conn: socket.socket) -> None:
        try:
            sender = self._hello(conn)
            if not sender:
                return
            _tune(conn)
            while not self._closed:
                # an idle stream waits this long for its next request's header, in all (a header
                # trickled a byte a minute would keep the slot)
                head = _recv_bytes(conn, _HEAD.size, time.monotonic() + _IDLE)
                conn.settimeout(self._timeout)
                self._request(conn, sender, head)
        except (OSError, ConnectionError, ValueError) as e:
            log.debug("stream connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _request(self, conn: socket.socket, sender: str, head: bytes) -> None:
        magic, op, kind, _, n = _HEAD.unpack(head)
        if magic != _MAGIC or op not in (1, 2) or kind >= len(_KINDS) or not 0 < n <= MAX_REQUEST_ROWS:
            raise ValueError("malformed stream request")  # out of step: drop the connection
        deadline = time.monotonic() + self._timeout  # for the whole request, however the peer trickles it
        rows = np.frombuffer(_recv_bytes(conn, 24 * n, deadline), np.uint64).reshape(n, 3)
        with self._inflight.use(conn) as use:
            self._serve_rows(conn, sender, op == 2, _KINDS[kind], rows, use, deadline)

    def _serve_rows(self, conn: socket.socket, sender: str, write: bool, kind: MemKind, rows: np.ndarray,
                    use, deadline: float) -> None:
        try:
            local, done = self._check("WRITE" if write else "READ", kind, rows, sender, use)
        except Exception as e:  # noqa: BLE001 - refused: the peer hears why
            if write:  # its declared payload follows; bounded by the row check's limit, else we hang up
                total = int(rows[:, 1].sum(dtype=np.uint64)) if (rows[:, 1] <= MAX_REQUEST_BYTES).all() else -1
                if not 0 <= total <= MAX_REQUEST_BYTES:
                    raise ValueError("refused WRITE with an impossible payload") from None
                _discard(conn, total, deadline)
            code = getattr(e, "code", "bad_request")
            text = str(e)[:1024].encode()
            _send_all(conn, _REPLY.pack(_CODES.index(code) if code in _CODES else 1, 0, len(text)) + text, deadline)
            return
        if write:
            recv_rows(conn, local, deadline)
            done()
            _send_all(conn, _REPLY.pack(0, 0, 0), deadline)
        else:
            _send_all(conn, _REPLY.pack(0, 0, 0), deadline)
            send_rows(conn, local, deadline)

    def close(self) -> None:
        self._closed = True
        cut(self._sock)
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            cut(c)


class Stream:
    """The initiator side of one peer's stream; used by that peer's worker thread only."""

    def __init__(self, sock: socket.socket, timeout: float, who: str):
        self._sock, self._timeout, self.who = sock, timeout, who
        self.aborted = False
        self._used = time.monotonic()

    @property
    def stale(self) -> bool:
        """Idle long enough that the owner may soon close it: open a new one
        (well before ``_IDLE``, so no request meets a stream being closed)."""
        return time.monotonic() - self._used > _IDLE / 3

    @classmethod
    def open(cls, host: str, port: int, token: bytes, timeout: float, who: str) -> "Stream | None":
        """A stream to the owner, or None if it serves as many as it can
        (the caller sends its bytes in ZMQ messages then)."""
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise PeerDisconnected(f"cannot open a data stream to {who}: {e}") from None
        try:
            _tune(sock)
            _send_all(sock, token, deadline)
            served = _recv_bytes(sock, 1, deadline) == b"\x01"
        except (OSError, ConnectionError):  # busy setting up others' streams, or gone: the ZMQ channel says which
            served = False
        if not served:
            sock.close()
            return None
        return cls(sock, timeout, who)

    def move(self, op: str, kind: MemKind, parts) -> None:
        """Requests for ``parts``, pairs of ``local`` (k, 2) host rows here and
        ``rrows`` (k, 3) rows at the peer.  Pipelined: up to ``_AHEAD`` more
        requests go out before an answer is read, so the stream does not idle
        between them; every answer is read, so a refused one keeps it in step.
        All of it within ``timeout``: after that (``TransferTimeout``) or an
        ``abort()`` the stream is closed and nothing more lands."""
        sock, code_of = self._sock, (_OPS[op], _KINDS.index(kind))
        deadline = time.monotonic() + self._timeout
        refused = None
        try:
            sent = 0
            for i, (local, _) in enumerate(parts):
                while sent < len(parts) and sent <= i + _AHEAD:
                    out, rrows = parts[sent]
                    _send_all(sock, _HEAD.pack(_MAGIC, *code_of, 0, len(rrows)) +
                              np.ascontiguousarray(rrows, np.uint64).tobytes(), deadline)
                    if op == "WRITE":
                        send_rows(sock, out, deadline)
                    sent += 1
                code, _, n = _REPLY.unpack(_recv_bytes(sock, _REPLY.size, deadline))
                if code:
                    text = _recv_bytes(sock, n, deadline).decode("utf-8", "replace")
                    refused = refused or RemoteRejected(f"{self.who} refused {op}: {text}")
                elif op == "READ":
                    recv_rows(sock, local, deadline)
        except socket.timeout:
            self.close()
            raise TransferTimeout(f"{self.who} did not finish streaming {op} within {self._timeout:g}s") from None
        except (OSError, ConnectionError) as e:
            self.close()
            raise PeerDisconnected(f"{self.who} closed the data stream during {op}: {e}") from None
        finally:
            self._used = time.monotonic()
        if refused is not None:
            raise refused

    def abort(self) -> None:
        """Cut a ``move`` running on another thread short (it raises ``PeerDisconnected``)."""
        self.aborted = True
        cut(self._sock)

    def close(self) -> None:
        self._sock.close()
