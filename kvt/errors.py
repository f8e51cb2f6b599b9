"""kvt's one error tree.  Only these escape kvt and its backends.

::

    KvtError
    ├── ConfigError               (ValueError)     bad configuration value; names the field
    ├── BackendNotFound           (LookupError)    unknown backend name, or known but not installed
    ├── BackendLoadError          (ImportError)    installed, but importing it failed
    ├── BackendUnavailable        (RuntimeError)   imported, but unusable on this machine
    ├── UnsupportedOperation      (NotImplementedError)  outside the backend's declared capabilities
    ├── InvalidArgument           (ValueError)     malformed input (shapes, kinds, sizes)
    │   └── InvalidDescriptor                      descriptors outside registered memory
    ├── UnknownPeer               (LookupError)    no such remote agent loaded
    ├── InvalidHandle             (LookupError)    unknown or already released handle
    ├── WireError                 (ValueError)     malformed bytes on the wire
    │   └── VersionMismatch                        well-formed, but a wire version we do not speak
    ├── HandshakeError            (ConnectionError)
    │   ├── HandshakeTimeout      (TimeoutError)   the peer never answered
    │   ├── IncompatiblePeer                       the peer answered, but cannot be paired with us
    │   └── AuthenticationError                    auth_key missing or different on one side (kvt.auth)
    ├── TransferError             (RuntimeError)   the cause carried by ``XferState.ERR``
    │   ├── PeerDisconnected      (ConnectionError) the peer died or went away mid-transfer
    │   ├── TransferTimeout       (TimeoutError)   no completion within the configured timeout
    │   ├── RemoteRejected                         the target refused the request (e.g. out of region)
    │   └── IntegrityError                         the bytes arrived, but not the bytes that were sent
    ├── DiscoveryError            (ConnectionError) the discovery store is unreachable or answered nonsense
    ├── KvtTimeoutError           (TimeoutError)   a blocking kvt call ran out of time
    └── ClosedError               (RuntimeError)   the agent or backend is closed

Each class also derives from the builtin in parentheses so that code which
catches ``LookupError`` or ``TimeoutError`` keeps working.  Backends map every
native error (NIXL status, ucxx exception, OSError, zmq error) to one of these
with ``raise ... from native``; the conformance suite checks that nothing else
escapes.
"""

from __future__ import annotations

__all__ = [
    "KvtError", "ConfigError", "BackendNotFound", "BackendLoadError",
    "BackendUnavailable", "UnsupportedOperation", "InvalidArgument",
    "InvalidDescriptor", "UnknownPeer", "InvalidHandle", "WireError",
    "VersionMismatch", "HandshakeError", "HandshakeTimeout", "IncompatiblePeer", "AuthenticationError",
    "TransferError", "PeerDisconnected", "TransferTimeout", "RemoteRejected",
    "KvtTimeoutError", "ClosedError", "IntegrityError", "DiscoveryError", "ServerBusy",
]


class KvtError(Exception):
    """Base of every error kvt raises."""


class ConfigError(KvtError, ValueError):
    """A configuration value is invalid; the message names the field."""


class BackendNotFound(KvtError, LookupError):
    """No installed backend has this name (the message lists installed ones,
    or names the package to install for a known backend)."""


class BackendLoadError(KvtError, ImportError):
    """The backend's entry point exists but importing it failed (cause chained)."""


class BackendUnavailable(KvtError, RuntimeError):
    """The backend imported but cannot run on this machine (reason in message)."""


class UnsupportedOperation(KvtError, NotImplementedError):
    """The operation is outside the backend's declared capabilities."""


class InvalidArgument(KvtError, ValueError):
    """Malformed input: wrong shape, dtype, memory kind or size."""


class InvalidDescriptor(InvalidArgument):
    """A descriptor falls outside registered memory; nothing was moved."""


class UnknownPeer(KvtError, LookupError):
    """No remote agent of this name has been loaded with ``add_remote``."""


class InvalidHandle(KvtError, LookupError):
    """The handle is unknown to this backend or was already released."""


class WireError(KvtError, ValueError):
    """Bytes received from a peer could not be decoded."""


class VersionMismatch(WireError):
    """The bytes decode, but carry a wire version this kvt does not speak."""


class HandshakeError(KvtError, ConnectionError):
    """Fetching a peer's metadata failed."""


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The peer did not answer the handshake within the timeout."""


class IncompatiblePeer(HandshakeError):
    """The peer answered but cannot be paired (model shape, dtype, layout...)."""


class AuthenticationError(HandshakeError):
    """A peer did not prove it holds our ``auth_key`` (or we do not hold its
    own): set the same ``auth_key`` on both sides.  A transfer refused for this
    reason ends ``ERR`` with ``RemoteRejected`` naming it."""


class TransferError(KvtError, RuntimeError):
    """Why a transfer ended in ``ERR``; carried by ``XferState.cause``."""


class PeerDisconnected(TransferError, ConnectionError):
    """The peer died or disconnected while the transfer was in flight."""


class TransferTimeout(TransferError, TimeoutError):
    """The transfer did not complete within the configured timeout."""


class RemoteRejected(TransferError):
    """The target refused the request (e.g. memory it never registered)."""


class IntegrityError(TransferError):
    """The checksum of what arrived differs from the sender's (kvt.integrity)."""


class DiscoveryError(KvtError, ConnectionError):
    """The discovery store (etcd, TCPStore) is unreachable or sent something unreadable."""


class KvtTimeoutError(KvtError, TimeoutError):
    """A blocking kvt helper (``wait``, ``get_notifs(timeout=...)``) timed out."""


class ClosedError(KvtError, RuntimeError):
    """The backend or agent has been closed."""


class ServerBusy(KvtError, RuntimeError):
    """A kvt server (``kvt.handshake.RouterServer``) holds
    ``MAX_UNSENT_REPLY_BYTES`` of replies for peers that do not read them, and
    this request's reply would pass that.  Raised inside the server, which
    answers it as a typed refusal (code ``busy``); nothing else happened: the
    peer may retry later."""

    code = "busy"
