"""Same-host notifications over a Unix socket of the owner's.

Through ZMQ a notification goes from the sender's thread to its ZMQ I/O
thread, over TCP to the owner's I/O thread, then to the owner's server
thread: ~70 us of the sender's thread right after a copy, and three
wake-ups.  Here it is one system call and no wake-up: nobody waits on the
socket; the owner reads it when it asks for its notifications
(``get_notifs``), and its server thread at least every 0.1 s (so they wait
in its bounded inbox, as ZMQ's do, not in the kernel).  The owner listens on a ``SOCK_SEQPACKET`` socket in the abstract
namespace (nothing is left on disk when a process dies) and advertises its
name in its metadata (``HostMetadata.notif``); a same-host peer connects
once and sends each notification as one message: the ``Request`` frame the
ZMQ channel would carry.  (Sequenced packets keep message boundaries, as
datagrams do, but are bounded by the sender's buffer, not by the kernel's
queue of ten datagrams a socket: an engine posts dozens of reads at once.)

Order (the protocol's contract: in the order sent): a notification too
large for the socket (over ``MAX_FRAME``), or one to a socket nobody reads
any more, moves that peer to ZMQ for good; the owner's server thread reads
its socket before it takes in a notification that came over ZMQ, so those
sent before it, on the socket, are in its inbox first.

Admission: the owner writes one byte, ``ADMITTED``, on each connection it
keeps; one over ``MAX_CONNECTIONS`` (or another user's) it accepts and
closes without it.  The kernel takes a new connection, and messages on it,
into the listening socket's backlog before the owner accepts it, so a sender
that sent at once lost every message sent before it was turned away (it
saw them sent).  A sender therefore puts nothing on the socket before it
has read that byte: until then its caller takes the message off the
posting thread (``send`` with no timeout answers False), and the lane's
worker waits for the byte (once per connection, within the timeout); a
connection closed without it, or no byte in time, sends the peer to ZMQ
for good, with nothing sent on the socket, so order holds.  Not ZMQ before
the byte and the socket after: the owner reads its socket before ZMQ, so a
later message on the socket would overtake an earlier one on ZMQ.  Once
admitted, the owner closes a connection only when it closes (its inbox
with it), or on a message no kvt sends (over ``MAX_FRAME``): every message
the kernel took reaches the owner's inbox, as over ZMQ.

Trust: an abstract socket has no file permissions, so the owner accepts only
connections of its own user, by the credentials the kernel gives
(``SO_PEERCRED``), and at most ``MAX_CONNECTIONS``; the bytes are then as
hostile as a ZMQ message's (the server's checks: one ``NOTIF`` request,
sender and size bounded).  With an ``auth_key`` notifications stay on the
authenticated ZMQ channel: sealed messages share the session's counter with
requests, which ZMQ carries, and two channels keep no order between them.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
import secrets
import select
import socket
import struct
import termios
import threading
import time
from typing import Callable

__all__ = ["ADMITTED", "MAX_FRAME", "MAX_CONNECTIONS", "NotifListener", "NotifLink", "valid_name"]

log = logging.getLogger(__name__)

MAX_FRAME = 64 << 10  #: the largest notification message (its Request frame); larger ones go over ZMQ
MAX_CONNECTIONS = 64  #: same-host peers connected at once; more are turned away (they use ZMQ)
_NAME = re.compile(r"kvt-notif-[0-9]{1,7}-[0-9a-f]{16}")  # NotifListener's names, and only those
ADMITTED = b"\x01"  #: the owner's first and only byte on a connection it keeps (see the module's docstring)
_UCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid
_ACCEPT = 16  # connections accepted per call: the server's other work gets its turn
_SNDBUF = 1 << 20  # asked of the kernel (it caps it): room for thousands of notifications in flight
# messages read from one connection per drain: more than a sender's buffer holds (each takes ~768 bytes
# of it), so a drain before a notification from ZMQ leaves none of that sender's behind it
_DRAIN = 4096
_POLL = 0.1  # seconds: how long messages may wait in the socket when the owner does not ask for them


def _gil_holding_epoll_wait():
    """``epoll_wait(fd, events, n, 0)`` called through ``ctypes.PyDLL``,
    which keeps the GIL (``select.epoll.poll`` lets go of it around the
    call); None where libc cannot be loaded (then ``drain`` polls through
    ``select`` each time).

    Why: an engine asks for notifications every step, thousands of times a
    second.  Letting go of the GIL and taking it back microseconds later,
    each time, starves every other thread of the process: a thread waiting
    for the GIL is woken by each release, finds it taken again when it gets
    to run on its CPU, and waits anew; CPython forces a switch only after
    5 ms without any release.  Measured under a real vLLM: the host
    backend's workers took seconds per step of a 10-row tcp READ."""
    try:
        fn = ctypes.PyDLL(None, use_errno=True).epoll_wait
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_epoll_wait = _gil_holding_epoll_wait()


def valid_name(name: object) -> bool:
    """Whether ``name`` (from a peer's metadata) is a notification socket's:
    a forged one must not aim our messages at another program's socket."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


class NotifListener:
    """The owner's end.  Its server thread accepts connections (``watch``:
    the server's ``RouterServer.watch``) and nobody waits on them: a sender's
    message wakes no one.  ``drain`` hands each message waiting, of a
    connection of our own user, to ``handle(frame)``: called by
    ``get_notifs`` and, as a backstop for an owner that never asks, by the
    server thread every ``_POLL`` s (``tick``)."""

    def __init__(self, watch: Callable[[int, Callable[[], None]], None], handle: Callable[[bytes], None]) -> None:
        self.name = f"kvt-notif-{os.getpid()}-{secrets.token_hex(8)}"
        self._handle = handle
        self._uid = os.geteuid()
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._ready = select.epoll()  # the connections with messages, found in one system call
        self._event = ctypes.create_string_buffer(16)  # room for one struct epoll_event (12 or 16 bytes)
        self._last = 0.0
        self.refused = 0  # connections turned away (another user's, or over MAX_CONNECTIONS) or cut (bad message)
        self._sock = _socket()
        try:
            self._sock.bind(b"\0" + self.name.encode())
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            self._ready.close()
            raise
        watch(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(_ACCEPT):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: the peer falls back to ZMQ
                log.warning("notification socket %s: accept failed: %s", self.name, e)
                return
            try:
                uid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
            except OSError:
                uid = None
            with self._lock:
                if uid != self._uid or len(self._conns) >= MAX_CONNECTIONS:
                    self.refused += 1
                    log.debug("notification socket %s: turned away a connection of uid %s (%d connected)",
                              self.name, uid, len(self._conns))
                    conn.close()  # without ADMITTED: the sender has sent nothing yet, and uses ZMQ
                    continue
                conn.setblocking(False)
                try:  # (one byte into an empty buffer: only a peer already gone fails it)
                    conn.send(ADMITTED, socket.MSG_NOSIGNAL)
                except OSError:
                    conn.close()
                    continue
                self._conns[conn.fileno()] = conn
                self._ready.register(conn.fileno(), select.EPOLLIN)

    def drain(self) -> None:
        """Hand every message waiting (at most ``_DRAIN`` per connection) to ``handle``."""
        with self._lock:
            self._last = time.monotonic()
            if self._ready.closed:  # (get_notifs racing the backend's close)
                return
            if _epoll_wait is not None and _epoll_wait(self._ready.fileno(), self._event, 1, 0) == 0:
                return  # nothing waiting (the common case), found holding the GIL
            for fd, _ in self._ready.poll(0):
                conn = self._conns[fd]
                for _ in range(_DRAIN):
                    try:
                        frame, _, flags, _ = conn.recvmsg(MAX_FRAME + 1)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        frame, flags = b"", 0
                    if not frame or flags & socket.MSG_TRUNC or len(frame) > MAX_FRAME:
                        if frame:  # (empty: the peer closed; kvt never sends an empty message)
                            self.refused += 1
                            log.debug("notification socket %s: cut a connection that sent %d bytes at once",
                                      self.name, len(frame))
                        self._ready.unregister(fd)
                        del self._conns[fd]
                        conn.close()
                        break
                    self._handle(frame)

    def tick(self) -> None:
        """On the server thread: ``drain`` if nobody did for ``_POLL`` s."""
        if time.monotonic() - self._last >= _POLL:
            self.drain()

    def close(self) -> None:
        """Once the server thread stopped."""
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
            self._ready.close()
            self._sock.close()


class NotifLink:
    """A same-host peer's end of its notification socket, connected on first
    use and used once the owner admitted it (``ADMITTED``).  Used by one
    thread at a time (the holder of the peer's lane)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sock: socket.socket | None = None
        self._admitted = False
        self._refused = False  # turned away (or never admitted in time): this link carries nothing more

    def send(self, frame: bytes, timeout: float | None) -> bool:
        """Send ``frame`` as one message: True once sent.  False when this
        channel cannot carry it (too large; the owner turned the connection
        away or did not admit it within ``timeout``; nobody reads the socket:
        the owner is gone, or out of reach in another network namespace):
        the caller moves to ZMQ for good.  ``timeout`` None: False also
        when it cannot go now (not admitted yet, or no room; never waits);
        else up to that many seconds for admission and room, then, if
        admitted, ``TimeoutError``."""
        if len(frame) > MAX_FRAME or self._refused:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self._sock is None:
                    sock = _socket()
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
                        sock.connect(b"\0" + self.name.encode())
                    except OSError:
                        sock.close()
                        raise
                    self._sock = sock
                if not self._admitted:
                    # a queued connection takes messages, and a turned-away one drops them unread
                    ack = self._sock.recv(1, socket.MSG_DONTWAIT)
                    if ack != ADMITTED:
                        return self._turned_away("closed the connection unadmitted" if not ack else "sent no kvt byte")
                    self._admitted = True
                self._sock.send(frame, socket.MSG_NOSIGNAL)
                return True
            except (BlockingIOError, InterruptedError):  # not admitted yet, no room, or the owner's backlog is full
                if deadline is None:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    if not self._admitted:  # nothing went on the socket: ZMQ carries this one, and keeps order
                        return self._turned_away(f"did not admit the connection within {timeout:g}s")
                    raise TimeoutError(f"the owner of {self.name} read no notification for {timeout:g}s") from None
                if self._sock is None:
                    time.sleep(min(left, 0.001))
                else:  # a connected socket turns readable at admission, writable when there is room
                    room = select.poll()
                    room.register(self._sock, select.POLLOUT if self._admitted else select.POLLIN)
                    room.poll(min(left, 0.05) * 1000)
            except OSError as e:
                log.debug("notification socket %s: %s; notifications go over ZMQ", self.name, e)
                if not self._admitted:
                    self._turned_away(str(e))
                return False

    def _turned_away(self, why: str) -> bool:
        log.debug("notification socket %s: the owner %s; notifications go over ZMQ", self.name, why)
        self._refused = True
        self.close()
        return False

    @property
    def admitted(self) -> bool:
        """Whether the owner admitted our connection (messages then go on it)."""
        return self._admitted

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def unread(self) -> int:
        """Bytes sent that the owner has not read yet (the kernel's ``SIOCOUTQ``)."""
        if self._sock is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            return 0
