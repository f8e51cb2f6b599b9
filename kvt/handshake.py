"""The ZMQ side channel through which agents fetch each other's metadata.

A ``HandshakeServer`` runs one daemon thread with a ROUTER socket (a
``RouterServer``, which backends reuse for their own servers) and answers
each request with ``provider(request_bytes)``; ``request`` is the client side
(a REQ socket used once, with send/receive timeouts).  The server binds to
127.0.0.1 unless told otherwise: metadata carries raw addresses, so exposing
it beyond the host is a decision the operator makes in configuration.

With a ``secret`` (configuration ``auth_key``) both ends speak kvt.auth's
challenge-response and seal every message; without one nothing changes.
Beneath that, a keyed server admits only connections that complete ZMQ's
CURVE handshake with keys derived from the secret (``curve_client``): ZMQ
holds a multipart message whole until its last frame, with no bound on the
frame count, so a peer without the key must not get to send frames at all.
"""

from __future__ import annotations

import ipaddress
import logging
import operator
import os
import re
import socket
import threading
import time
from typing import Callable

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from .auth import ClientSession, Secret, ServerAuth
from .errors import (AuthenticationError, ConfigError, HandshakeError, HandshakeTimeout, InvalidArgument, KvtError,
                     ServerBusy, WireError)

__all__ = ["RouterServer", "HandshakeServer", "request", "connect", "curve_client"]

log = logging.getLogger(__name__)
_POLL_MS = 100  # how often the server thread checks for close()
#: largest handshake message a server or client accepts (ZMQ drops the connection of a bigger one)
MAX_HANDSHAKE_BYTES = 16 << 20
_HWM = 4
#: most frames of one inbound message after the sender's identity (kvt sends at most 3); more: dropped
MAX_FRAMES = 8
#: reply bytes a ``RouterServer`` hands ZMQ and ZMQ has not sent yet (peers that do not read them), over
#: all peers; a reply that would pass it is replaced by the channel's typed refusal (``ServerBusy``)
MAX_UNSENT_REPLY_BYTES = 256 << 20
_ENVELOPE = 4096  # what a message may hold beyond ``max_msg_bytes`` in all: identity, delimiter, auth frame
#: a connection that has not finished ZMQ's handshake (greeting, CURVE) by then is dropped
HANDSHAKE_IVL_MS = 5000
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MAX_MS = 2**31 - 1  # ZMQ's waits take a C int of milliseconds (24.8 days)


def _ms(seconds: float) -> int:
    """A ZMQ wait of ``seconds``: at least 1 ms, at most what its int holds
    (a longer timeout, which the config allows, raised OverflowError)."""
    return max(1, min(int(seconds * 1000), _MAX_MS))


def check_bind(host: object, port: object) -> tuple[str, int]:
    """``(host, port)`` to bind to, or ``InvalidArgument``: ZMQ takes the
    endpoint as text, so a port of 99999, -1 or 1.5 bound some other port
    while the endpoint named this one, and a host that is no text crashed."""
    if not isinstance(port, bool):
        try:
            port = operator.index(port)
        except TypeError:
            pass
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be an int in 0..65535 (0: any free port), got {port!r}"[:160])
    ok = isinstance(host, str) and host and "\0" not in host
    try:
        ok = ok and bool(host.encode())
    except UnicodeEncodeError:  # a lone surrogate
        ok = False
    if not ok:
        raise InvalidArgument(f"host must be a non-empty host name or IP address, got {host!r}"[:160])
    return host, port


def _curve_pair(secret: Secret, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of ``role``, derived from the shared key.
    The server's public key is never sent, so only key holders can open the
    handshake (its HELLO is a box to that key)."""
    if not zmq.has("curve"):
        raise ConfigError(f"auth_key needs ZMQ with CURVE, and this libzmq ({zmq.zmq_version()}) has none: "
                          "install pyzmq's wheel (it bundles libsodium) or a libzmq built with it")
    sk = zmq.utils.z85.encode(secret.sign(b"zmq-curve-" + role, b""))
    return zmq.curve_public(sk), sk


def curve_client(sock: zmq.Socket, secret: Secret) -> None:
    """Set, before ``connect``, the CURVE keys a keyed ``RouterServer`` admits."""
    sock.curve_serverkey = _curve_pair(secret, b"server")[0]
    sock.curve_publickey, sock.curve_secretkey = _curve_pair(secret, b"client")


def _nbytes(frame) -> int:
    return memoryview(getattr(frame, "buffer", frame)).nbytes


class RouterServer:
    """A daemon thread answering multipart messages on a ZMQ ROUTER socket.

    ``handle(frames)`` gets the frames after the sender's identity and
    returns the reply frames, or ``None`` for no reply.  Should it raise
    anyway, ``refuse(frames, error)`` builds the reply (the peer always hears
    back, with a typed refusal) and serving goes on; nothing a peer sends
    stops the thread.  ``copy=False`` hands ``zmq.Frame`` objects (zero-copy)
    to ``handle``.  ``max_msg_bytes`` caps every inbound frame (ZMQ
    disconnects a peer that sends a bigger one before it is buffered) and,
    checked here, the sum of a message's frames; a message over it or over
    ``MAX_FRAMES`` frames is dropped frame by frame, unanswered.  ZMQ hands
    over a multipart message only once all its frames arrived, so until then
    it holds them all: nothing in ZMQ bounds how many frames one message has
    (docs/security.md).
    Replies waiting in ZMQ for peers that do not read them are bounded over
    all peers (``max_unsent_bytes``): past it a reply's request gets
    ``refuse(frames, ServerBusy(...))`` instead.
    Bound to ``host`` (port 0 = any free port); ``endpoint`` says where.
    ZMQ's ROUTER queues each peer's messages apart and takes them in turn,
    so with bounded work per message no peer starves another.
    With ``secret`` every message must be authenticated (kvt.auth; ``covered``:
    how many leading frames the tags hash, None = all); ``handle`` and
    ``refuse`` see the same frames as without.
    """

    def __init__(self, handle: Callable[[list], list | None], host: str = "127.0.0.1", port: int = 0,
                 *, name: str = "kvt-router", copy: bool = True, max_msg_bytes: int = MAX_HANDSHAKE_BYTES,
                 refuse: Callable[[list, Exception], list | None] | None = None,
                 secret: Secret | None = None, covered: int | None = None,
                 max_unsent_bytes: int | None = None):
        host, port = check_bind(host, port)  # before any socket exists
        self._handle, self._copy, self._refuse = handle, copy, refuse
        self._max_msg = max_msg_bytes
        self._max_unsent = MAX_UNSENT_REPLY_BYTES if max_unsent_bytes is None else max_unsent_bytes
        self._unsent: list[tuple[int, zmq.MessageTracker]] = []  # large replies ZMQ still holds
        self._auth = None if secret is None else ServerAuth(secret, covered)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        # a few messages queued per peer each way: a peer that floods requests, or never reads its
        # replies, is throttled by TCP back-pressure (or loses replies) instead of filling our memory
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if secret is not None:  # no frame of a peer without the key gets into ZMQ's queues (module doc)
            self._sock.curve_server = True
            self._sock.curve_secretkey = _curve_pair(secret, b"server")[1]
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise HandshakeError(f"cannot listen on {host}:{port}: {e}; choose another "
                                 "listen_host/listen_port") from e
        self.endpoint = f"tcp://{host}:{port}"
        self._watched: dict[int, Callable[[], None]] = {}  # fds served besides the socket (watch)
        #: called on the server thread after each wait for messages (at least every _POLL_MS ms)
        self.tick: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{name}:{port}", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def watch(self, fd: int, ready: Callable[[], None]) -> None:
        """Call ``ready()`` on the server thread whenever ``fd`` turns
        readable (register before ``start``).  Like ``tick``: what it raises is
        logged and serving goes on; bounded work per call (the socket's
        messages wait meanwhile)."""
        self._watched[fd] = ready

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a backstop: nothing a peer sends stops the thread
            log.exception("%s: %s failed", self._thread.name, getattr(fn, "__qualname__", fn))

    def _serve(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for fd in self._watched:
            poller.register(fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ours = False
                for s, _ in poller.poll(_POLL_MS):
                    if s is sock:
                        ours = True
                    else:
                        self._call(self._watched[s])
                if self.tick is not None:
                    self._call(self.tick)
                if not ours:
                    continue
                msg = self._recv(sock)
                if msg is None:
                    continue
                ident, *frames = msg
                if self._auth is None:
                    reply = self._answer(frames)
                else:
                    try:
                        reply = self._auth.serve(frames, self._answer, self._refuse_quietly)
                    except Exception as e:  # noqa: BLE001 - a backstop: nothing a peer sends stops the thread
                        log.warning("%s: dropped a message: %s", self._thread.name, type(e).__name__)
                        reply = None
                if reply is not None:
                    self._send(sock, ident, reply)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.error("%s stopped: %s", self._thread.name, e)
        finally:
            sock.close()

    def _recv(self, sock: zmq.Socket) -> list | None:
        """One message, frame by frame; None for one over ``MAX_FRAMES`` frames
        or ``max_msg_bytes`` in all, whose frames are each released as soon as
        received (ZMQ holds a message's frames until the last arrived, but we
        keep none of them: no second copy, no Python objects)."""
        frames, total, more = [], 0, True
        while more:
            f = sock.recv(copy=False)
            more = f.more
            total += len(f)
            frames.append(f)
            if len(frames) > MAX_FRAMES + 1 or total > self._max_msg + _ENVELOPE:
                del frames[:], f
                n = total
                while more:
                    f = sock.recv(copy=False)
                    more, n = f.more, n + len(f)
                    del f
                log.debug("%s: dropped a message over %d frames or %d bytes (%d bytes)",
                          self._thread.name, MAX_FRAMES, self._max_msg, n)
                return None
        return frames if not self._copy else [f.bytes for f in frames]

    def _send(self, sock: zmq.Socket, ident, reply: list) -> None:
        """Hand ``reply`` to ZMQ; its large frames go zero-copy and tracked, so
        ``_room`` knows how many reply bytes still wait for a slow peer."""
        out, tracked, size = [ident], [], 0
        for f in reply:
            n = _nbytes(f)
            if n >= zmq.COPY_THRESHOLD:  # smaller ones ZMQ copies at once (and drops with the peer's queue)
                f = zmq.Frame(getattr(f, "buffer", f), track=True, copy=False)
                tracked.append(f)
                size += n
            out.append(f)
        try:
            sock.send_multipart(out, copy=False)
        except zmq.Again:
            return  # that peer stopped reading; it gets no more than it asked for
        if tracked:
            self._unsent.append((size, zmq.MessageTracker(*tracked)))

    def _room(self, reply: list) -> bool:
        """Whether ``reply``'s zero-copy frames fit under ``max_unsent_bytes``."""
        nbytes = sum(n for n in map(_nbytes, reply) if n >= zmq.COPY_THRESHOLD)
        if not nbytes:
            return True
        self._unsent = [u for u in self._unsent if not u[1].done]
        return sum(n for n, _ in self._unsent) + nbytes <= self._max_unsent

    def _answer(self, frames: list) -> list | None:
        try:
            reply = self._handle(frames)
            if reply is not None and not self._room(reply):
                raise ServerBusy(f"{self._thread.name} has {self._max_unsent >> 20} MiB of replies waiting for "
                                 "peers that do not read them; retry later")
            return reply
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the server
            # malformed bytes are routine from a hostile peer (debug, so they cannot flood the log)
            log.log(logging.DEBUG if isinstance(e, KvtError) else logging.WARNING,
                    "%s: refused a message: %s: %s", self._thread.name, type(e).__name__, e)
            if self._refuse is None:
                return None
            try:
                return self._refuse(frames, e)
            except Exception:  # noqa: BLE001
                log.exception("%s: cannot even refuse", self._thread.name)
                return None

    def _refuse_quietly(self, frames: list, e: Exception) -> list | None:
        """The typed refusal of an unauthenticated message (routine from a hostile peer: debug log)."""
        log.debug("%s: refused an unauthenticated message: %s", self._thread.name, e)
        try:
            return self._refuse(frames, e) if self._refuse is not None else None
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        """Stop serving (idempotent); returns once the socket is closed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * _POLL_MS / 1000 + 1)
        elif not self._thread.ident:
            self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class HandshakeServer(RouterServer):
    """Serve ``provider(request) -> reply`` to ``request()`` clients.  A
    provider that raises answers with ``refuse(error)`` (default: empty
    bytes) and the server goes on."""

    def __init__(self, provider: Callable[[bytes], bytes], host: str = "127.0.0.1", port: int = 0,
                 refuse: Callable[[Exception], bytes] = lambda e: b"", secret: Secret | None = None):
        def answer(frames: list) -> list:  # a REQ client sends [b"", body]
            if len(frames) != 2 or frames[0]:
                raise WireError(f"expected a REQ envelope of 2 frames, got {len(frames)}")
            return [b"", provider(frames[1])]

        super().__init__(answer, host, port, name="kvt-handshake",
                         refuse=lambda frames, e: [b"", refuse(e)], secret=secret)


def connect(kind: int, endpoint: str, secret: Secret | None, timeout: float, who: str, *,
            max_msg_bytes: int = MAX_HANDSHAKE_BYTES, covered: int | None = None,
            settle: bool = True) -> tuple[zmq.Socket, ClientSession | None]:
    """A ZMQ socket of ``kind`` connected to the ``RouterServer`` at
    ``endpoint`` once ZMQ's handshake is done, and with ``secret`` the kvt.auth
    session opened on it (its messages go through that session).  Without a
    secret and with ``settle=False`` it returns at once, connecting in the
    background as ZMQ does (a peer that is not up yet gets what we send later).

    ``AuthenticationError`` at once if the server drops ZMQ's handshake (it
    has another key, or we have one and it none, or the other way round) or
    cannot prove the key; ``HandshakeTimeout`` if no handshake completes
    within ``timeout`` seconds (including a peer that is not there at all);
    ``HandshakeError`` for a bad endpoint."""
    if timeout <= 0:
        raise InvalidArgument(f"handshake timeout must be > 0 seconds, got {timeout}")
    deadline = time.monotonic() + timeout
    sock = _socket(kind, who)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        if secret is not None:
            curve_client(sock, secret)
        if secret is None and not settle:
            _connect(sock, endpoint, who, deadline)
            return sock, None
        _handshake(sock, endpoint, deadline, secret is not None, who)
        session = None
        if secret is not None:
            session = ClientSession(secret, covered)
            sock.send(session.hello())
            if not sock.poll(_ms(deadline - time.monotonic())):
                raise HandshakeTimeout(f"{who} did not answer the authentication challenge within {timeout:g}s")
            session.accept(sock.recv_multipart(), who)
        return sock, session
    except BaseException:
        sock.close()
        raise


def _socket(kind: int, who: str) -> zmq.Socket:
    try:
        return zmq.Context.instance().socket(kind)
    except zmq.ZMQError as e:  # e.g. EMFILE: peers can hold many of our fds
        raise HandshakeError(f"cannot open a socket to {who}: {e} (at the open-file limit? raise `ulimit -n`)") from e


_TCP = re.compile(r"tcp://(?P<host>[^\[\]]+):(?P<port>[0-9]{1,5})")


class _Lookups:
    """Name lookups, each on a thread of its own so that a caller leaves at
    its deadline; at most ``LIMIT`` at once, so slow names cannot pile up
    threads.  A forked child starts with none (their threads did not fork)."""

    LIMIT = 32

    def __init__(self) -> None:
        self._lock, self._busy = threading.Lock(), 0

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1

    def address(self, host: str, port: int, deadline: float, who: str) -> str:
        with self._lock:
            if self._busy >= self.LIMIT:
                raise HandshakeError(f"cannot look up {host!r} for {who}: {self.LIMIT} name lookups are already "
                                     "under way (a slow DNS?); give endpoints as IP addresses")
            self._busy += 1
        box: list = []

        def run() -> None:
            try:
                box.append(socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM))
            except Exception as e:  # noqa: BLE001 - reported to the caller below
                box.append(e)
            finally:
                self._done()

        t = threading.Thread(target=run, name="kvt-lookup", daemon=True)
        t.start()
        t.join(max(deadline - time.monotonic(), 0))
        if not box:
            raise HandshakeTimeout(f"looking up {host!r} for {who} did not finish in time")
        if isinstance(box[0], Exception) or not box[0]:
            raise HandshakeError(f"cannot look up {host!r} for {who}: {box[0]}")
        return box[0][0][4][0]


_lookups = _Lookups()
os.register_at_fork(after_in_child=_lookups.__init__)


def _numeric(endpoint: str, deadline: float, who: str) -> str:
    """``endpoint`` with its host name looked up here, by the deadline.
    ZMQ looks names up on its one I/O thread with a blocking getaddrinfo: a
    name whose DNS answers slowly (a peer can name one) stalled every kvt
    socket of the process, servers included, for as long."""
    m = _TCP.fullmatch(endpoint)
    if m is None:
        return endpoint  # not tcp, or an IPv6 literal: nothing to look up
    try:
        ipaddress.IPv4Address(m["host"])
        return endpoint
    except ValueError:
        return f"tcp://{_lookups.address(m['host'], int(m['port']), deadline, who)}:{m['port']}"


def _connect(sock: zmq.Socket, endpoint: str, who: str, deadline: float) -> None:
    endpoint = _numeric(endpoint, deadline, who)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise HandshakeError(f"cannot connect to {who}: {e}") from e


def _handshake(sock: zmq.Socket, endpoint: str, deadline: float, keyed: bool, who: str) -> None:
    """Connect ``sock`` and wait for ZMQ's handshake, watched by a monitor
    (the only place ZMQ tells a dropped handshake from a slow peer).  A
    mechanism mismatch (a key on one side only) ends it at once; so does a
    handshake the server drops twice in a row: another key, or a key on one
    side only when the server's reset overtakes its greeting (across a real
    link, about one attempt in three, sometimes nine in a row).  ZMQ
    reconnects after anything else (a server going down meanwhile) until the
    deadline."""
    try:
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
    except zmq.ZMQError as e:
        raise HandshakeError(f"cannot watch the connection to {who}: {e} (at the open-file limit? raise "
                             "`ulimit -n`)") from e
    dropped = 0
    try:
        _connect(sock, endpoint, who, deadline)
        while (left := deadline - time.monotonic()) > 0 and monitor.poll(_ms(left)):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            dropped += event != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL or dropped >= 2:
                why = ("it has another auth_key, or none, or runs an older kvt" if keyed else "it has an auth_key")
                raise AuthenticationError(f"{who} dropped the connection in ZMQ's handshake ({why}, or it is no "
                                          "kvt server): set the same auth_key (or KVT_AUTH_KEY) on both sides")
        raise HandshakeTimeout(f"no handshake with {who} within the timeout; is the peer running and "
                               "listening there?")
    finally:
        sock.disable_monitor()
        monitor.close()


def request(endpoint: str, payload: bytes, timeout: float, secret: Secret | None = None) -> bytes:
    """Send ``payload`` to a ``HandshakeServer`` and return its reply.

    With ``secret``, first the challenge-response of kvt.auth (both sides
    prove the key), then ``payload`` sealed; ``AuthenticationError`` if the
    server drops our connection (``connect``), cannot prove the key, refuses
    ours, or its reply fails its tag.  Raises ``HandshakeTimeout`` if no
    reply arrives within ``timeout`` seconds (including a peer that is not
    there at all), ``HandshakeError`` for a bad endpoint or transport failure.
    """
    who, start = f"peer at {endpoint}", time.monotonic()
    sock, session = connect(zmq.REQ, endpoint, secret, timeout, who)
    ms = _ms(timeout - (time.monotonic() - start))  # what is left of it, for each way
    try:
        sock.setsockopt(zmq.SNDTIMEO, ms)
        sock.setsockopt(zmq.RCVTIMEO, ms)
        if session is None:
            sock.send(payload)
            return sock.recv()
        sock.send_multipart([payload, session.seal([payload])])
        reply = session.open(sock.recv_multipart(), who)
        if reply is None or len(reply) != 1:
            raise AuthenticationError(f"{who} answered another message than ours")
        return reply[0]
    except zmq.Again as e:
        raise HandshakeTimeout(f"no handshake reply from {endpoint} within {timeout:g}s; is the peer "
                               "running and listening there?") from e
    except zmq.ZMQError as e:
        raise HandshakeError(f"handshake with {endpoint} failed: {e}") from e
    finally:
        sock.close()
