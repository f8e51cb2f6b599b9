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
connection to that peer.  Unknown, reused or late tokens get the connection
closed.  Then, per request (little-endian)::

    initiator -> owner   "kvtS" op:u8 kind:u8 0:u16 rows:u32 | rows x (addr, len, dev):u64 | WRITE: payload
                         (up to _AHEAD more requests may follow before the first answer is read)
    owner -> initiator   code:u8 0:u8 text_len:u16 | text | READ and code 0: payload

The owner checks the rows exactly as its ZMQ server does (``Server.checked``)
before any byte moves; a refused WRITE's payload is read and dropped, so the
stream stays in step.  Each connection has its own thread at the owner and a
socket timeout: a peer that stalls, lies about lengths or disconnects loses
its own connection, nothing else.
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
from kvt.errors import PeerDisconnected, RemoteRejected, TransferError, TransferTimeout
from kvt.types import MemKind

from .memops import gather, scatter
from .protocol import MAX_REQUEST_BYTES, MAX_REQUEST_ROWS

log = logging.getLogger(__name__)

__all__ = ["StreamServer", "Stream"]

_HEAD = struct.Struct("<4sBBHI")
_REPLY = struct.Struct("<BBH")
_MAGIC = b"kvtS"
_OPS = {"READ": 1, "WRITE": 2}
_KINDS = list(MemKind)
_CODES = ["", "bad_request", "out_of_region", "busy"]
_TOKEN = 16
_TOKEN_TTL = 30.0           # seconds a token may wait for its connection
_MAX_TOKENS = 256           # tokens outstanding at once
_MAX_CONNECTIONS = 64       # stream connections an owner serves at once
_HELLO_TIMEOUT = 5.0        # seconds a new connection has to present its token
_AHEAD = 2                  # requests an initiator sends before reading the first one's answer
_DIRECT = 256 << 10         # rows at least this long (on average) move straight from/to memory



def _tune(sock: socket.socket) -> None:
    # no SO_SNDBUF/SO_RCVBUF: fixing them turns off the kernel's autotuning, which measured as fast or faster
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the other side closed the stream")
        got += k


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_rows(sock: socket.socket, rows: np.ndarray) -> None:
    """The bytes of ``(k, 2)`` (address, length) rows, in order."""
    if not len(rows):
        return
    if int(rows[:, 1].sum()) >= _DIRECT * len(rows):
        for addr, n in rows.tolist():
            sock.sendall(_view(addr, n))
    else:
        sock.sendall(gather(rows))


def recv_rows(sock: socket.socket, rows: np.ndarray) -> None:
    """Fill ``(k, 2)`` (address, length) rows from the stream, in order."""
    if not len(rows):
        return
    if int(rows[:, 1].sum()) >= _DIRECT * len(rows):
        for addr, n in rows.tolist():
            _recv_exact(sock, _view(addr, n))
    else:
        buf = np.empty(int(rows[:, 1].sum()), np.uint8)
        _recv_exact(sock, memoryview(buf))
        scatter(rows, buf)


def _discard(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        k = sock.recv_into(scratch[:min(n, len(scratch))])
        if not k:
            raise ConnectionError("the other side closed the stream")
        n -= k


class StreamServer:
    """The owner side: a listening socket, the tokens handed out, a thread per connection.

    ``serve(op, kind, rows, sender)`` is the ZMQ server's own check: it returns
    the ``(k, 2)`` host rows to copy from or into and a ``done()`` to call after
    a WRITE landed (device staging), or raises ``Refused``."""

    def __init__(self, host: str, check, timeout: float):
        self._check, self._timeout = check, timeout
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self._tokens: dict[bytes, tuple[str, float]] = {}
        self._conns: set[socket.socket] = set()
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
                full = len(self._conns) >= _MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"kvt-host-stream:{self.port}",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(min(self._timeout, _HELLO_TIMEOUT))
            token = _recv_bytes(conn, _TOKEN)
            with self._lock:
                sender, until = self._tokens.pop(token, ("", 0.0))
            if not sender or until < time.monotonic():
                return  # unknown, reused or late: nothing more for this connection
            _tune(conn)
            while not self._closed:
                conn.settimeout(None)  # an idle stream waits for its next request
                head = _recv_bytes(conn, _HEAD.size)
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
        rows = np.frombuffer(_recv_bytes(conn, 24 * n), np.uint64).reshape(n, 3)
        write = op == 2
        try:
            local, done = self._check("WRITE" if write else "READ", _KINDS[kind], rows, sender)
        except Exception as e:  # noqa: BLE001 - refused: the peer hears why
            if write:  # its declared payload follows; bounded by the row check's limit, else we hang up
                total = int(rows[:, 1].sum(dtype=np.uint64)) if (rows[:, 1] <= MAX_REQUEST_BYTES).all() else -1
                if not 0 <= total <= MAX_REQUEST_BYTES:
                    raise ValueError("refused WRITE with an impossible payload") from None
                _discard(conn, total)
            code = getattr(e, "code", "bad_request")
            text = str(e)[:1024].encode()
            conn.sendall(_REPLY.pack(_CODES.index(code) if code in _CODES else 1, 0, len(text)) + text)
            return
        if write:
            recv_rows(conn, local)
            done()
            conn.sendall(_REPLY.pack(0, 0, 0))
        else:
            conn.sendall(_REPLY.pack(0, 0, 0))
            send_rows(conn, local)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Stream:
    """The initiator side of one peer's stream; used by that peer's worker thread only."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float, who: str):
        self.who = who
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
            _tune(self._sock)
            self._sock.sendall(token)
        except OSError as e:
            raise PeerDisconnected(f"cannot open a data stream to {who}: {e}") from None

    def move(self, op: str, kind: MemKind, parts) -> None:
        """Requests for ``parts``, pairs of ``local`` (k, 2) host rows here and
        ``rrows`` (k, 3) rows at the peer.  Pipelined: up to ``_AHEAD`` more
        requests go out before an answer is read, so the stream does not idle
        between them; every answer is read, so a refused one keeps it in step."""
        sock, code_of = self._sock, (_OPS[op], _KINDS.index(kind))
        refused = None
        try:
            sent = 0
            for i, (local, _) in enumerate(parts):
                while sent < len(parts) and sent <= i + _AHEAD:
                    out, rrows = parts[sent]
                    sock.sendall(_HEAD.pack(_MAGIC, *code_of, 0, len(rrows)) +
                                 np.ascontiguousarray(rrows, np.uint64).tobytes())
                    if op == "WRITE":
                        send_rows(sock, out)
                    sent += 1
                code, _, n = _REPLY.unpack(_recv_bytes(sock, _REPLY.size))
                if code:
                    text = _recv_bytes(sock, n).decode("utf-8", "replace")
                    refused = refused or RemoteRejected(f"{self.who} refused {op}: {text}")
                elif op == "READ":
                    recv_rows(sock, local)
        except socket.timeout:
            self.close()
            raise TransferTimeout(f"{self.who} stopped streaming during {op}") from None
        except (OSError, ConnectionError) as e:
            self.close()
            raise PeerDisconnected(f"{self.who} closed the data stream during {op}: {e}") from None
        if refused is not None:
            raise refused

    def close(self) -> None:
        self._sock.close()
