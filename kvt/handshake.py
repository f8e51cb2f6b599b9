"""The ZMQ side channel through which agents fetch each other's metadata.

A ``HandshakeServer`` runs one daemon thread with a ROUTER socket (a
``RouterServer``, which backends reuse for their own servers) and answers
each request with ``provider(request_bytes)``; ``request`` is the client side
(a REQ socket used once, with send/receive timeouts).  The server binds to
127.0.0.1 unless told otherwise: metadata carries raw addresses, so exposing
it beyond the host is a decision the operator makes in configuration.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import zmq

from .errors import HandshakeError, HandshakeTimeout, InvalidArgument

__all__ = ["RouterServer", "HandshakeServer", "request"]

log = logging.getLogger(__name__)
_POLL_MS = 100  # how often the server thread checks for close()


class RouterServer:
    """A daemon thread answering multipart messages on a ZMQ ROUTER socket.

    ``handle(frames)`` gets the frames after the sender's identity and
    returns the reply frames, or ``None`` for no reply.  It must not raise;
    an exception is logged and the message dropped, and serving goes on.
    ``copy=False`` hands ``zmq.Frame`` objects (zero-copy) to ``handle``.
    Bound to ``host`` (port 0 = any free port); ``endpoint`` says where.
    """

    def __init__(self, handle: Callable[[list], list | None], host: str = "127.0.0.1", port: int = 0,
                 *, name: str = "kvt-router", copy: bool = True):
        self._handle, self._copy = handle, copy
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{name}:{port}", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _serve(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                ident, *frames = sock.recv_multipart(copy=self._copy)
                try:
                    reply = self._handle(frames)
                except Exception:  # one bad message must not stop the server
                    log.exception("%s: handler failed", self._thread.name)
                    continue
                if reply is not None:
                    sock.send_multipart([ident, *reply], copy=self._copy)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.error("%s stopped: %s", self._thread.name, e)
        finally:
            sock.close()

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
    provider that raises answers with empty bytes and the server goes on."""

    def __init__(self, provider: Callable[[bytes], bytes], host: str = "127.0.0.1", port: int = 0):
        def answer(frames: list) -> list:  # a REQ client sends [b"", body]
            try:
                reply = provider(frames[-1])
            except Exception:
                log.exception("handshake provider failed")
                reply = b""
            return [*frames[:-1], reply]

        super().__init__(answer, host, port, name="kvt-handshake")


def request(endpoint: str, payload: bytes, timeout: float) -> bytes:
    """Send ``payload`` to a ``HandshakeServer`` and return its reply.

    Raises ``HandshakeTimeout`` if no reply arrives within ``timeout`` seconds
    (including a peer that is not there at all), ``HandshakeError`` for a bad
    endpoint or transport failure.
    """
    if timeout <= 0:
        raise InvalidArgument(f"handshake timeout must be > 0 seconds, got {timeout}")
    sock = zmq.Context.instance().socket(zmq.REQ)
    ms = max(1, int(timeout * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    try:
        sock.connect(endpoint)
        sock.send(payload)
        return sock.recv()
    except zmq.Again as e:
        raise HandshakeTimeout(f"no handshake reply from {endpoint} within {timeout:g}s; is the peer "
                               "running and listening there?") from e
    except zmq.ZMQError as e:
        raise HandshakeError(f"handshake with {endpoint} failed: {e}") from e
    finally:
        sock.close()
