"""Peer authentication with a shared secret (configuration ``auth_key``).

Every kvt ZMQ channel (the handshake side channel and the host backend's
data server, both ``kvt.handshake.RouterServer``) speaks the same small
protocol when a key is set.  It adds one frame at the end of each message:

1. client -> ``HELLO cn``  (16 random bytes)
2. server -> ``CHALLENGE sn tag``: ``sn = MAC(server secret, cn | time slot)``
   (16 bytes; the server secret is random per server and never leaves it, a
   slot is ``_SLOT_S`` seconds) and ``tag = MAC(K, "server")`` with the session
   key ``K = HMAC-SHA256(auth_key, "kvt-auth-v1" | cn | sn)``.  The client
   checks the tag before it sends anything: the server proved it holds the key.
   The server keeps nothing per HELLO, so a flood of them evicts nothing.
3. client -> ``frames..., SEALED cn sn counter tag`` with
   ``tag = MAC(K, "req" | counter | frames)``: the client proves the key.  The
   first valid message (``sn`` recomputed for the current or the previous
   slot, then the tag) opens the session ``(cn, sn)``; ``counter`` must grow
   with every message of a session, so a replayed or reordered message is
   refused.  The server remembers every ``sn`` that opened a session until
   its slot has expired (then ``sn`` itself is refused), so a recorded first
   message replayed once its session is gone cannot open a second one.
4. server -> ``frames..., REPLY counter MAC(K, "rep" | counter | frames)``:
   the reply is bound to that request.

A message that fails any check gets the channel's own typed refusal (readable
by a peer without a key) followed by a ``REFUSED reason`` frame, and nothing
else: no metadata, no memory.  Keys and tags are compared with
``hmac.compare_digest``.  ``covered`` limits which leading frames a tag
hashes: the host data channel MACs its request/reply header (rows, sender,
notifications) and only the *length* of bulk payload frames; bulk bytes are
left to integrity checks (``KVT_INTEGRITY``) — see docs/security.md.

``MAC`` is keyed BLAKE2b-256; the session key is derived with HMAC-SHA256.
Without a key none of this runs and the wire is as before.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict
from typing import Callable, Sequence

from .errors import AuthenticationError

__all__ = ["Secret", "ClientSession", "ServerAuth", "NotifSeal", "MIN_KEY_CHARS"]

MIN_KEY_CHARS = 16  # a shorter shared secret is refused at configuration time
_MAGIC = b"kvtA2"      # the channel protocol (v2: stateless challenges, SEALED carries cn)
_OLD_MAGIC = b"kvtA1"  # the previous one: refused with a message saying so
_NOTIF_MAGIC = b"kvtN2"  # NotifSeal's format (kvtA1 M before its key was derived: dropped, as forged)
_HELLO, _CHALLENGE, _SEALED, _REPLY, _REFUSED = b"H", b"C", b"M", b"R", b"X"
_NONCE, _TAG = 16, 32
_COUNTER = struct.Struct("<Q")
_HELLO_LEN = len(_MAGIC) + 1 + _NONCE
_CHALLENGE_LEN = len(_MAGIC) + 1 + _NONCE + _TAG
_SEALED_LEN = len(_MAGIC) + 1 + 2 * _NONCE + 8 + _TAG
_REPLY_LEN = len(_MAGIC) + 1 + 8 + _TAG
_SLOT_S = 20.0          # a challenge opens a session within 20..40 s (its slot and the next)
_MAX_SESSIONS = 4096    # proven sessions (only key holders create these; oldest dropped)
_MAX_OPENED = 1 << 18   # sessions opened per two slots (only key holders; beyond: refused, retry)
_now = time.monotonic   # the slots' clock (tests replace it)

_SET_SAME_KEY = "set the same auth_key (or KVT_AUTH_KEY) on both sides"


class Secret:
    """The shared key.  Its repr and str never show it."""

    __slots__ = ("_key",)

    def __init__(self, key: "str | bytes | Secret"):
        self._key = key._key if isinstance(key, Secret) else (key.encode() if isinstance(key, str) else bytes(key))

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("kvt.auth.Secret is not picklable; pass the configuration (auth_key) instead")

    def session_key(self, cn: bytes, sn: bytes) -> bytes:
        return hmac.new(self._key, b"kvt-auth-v1" + cn + sn, hashlib.sha256).digest()

    def sign(self, label: bytes, data: bytes) -> bytes:
        """A 32-byte tag of ``data`` (keyed BLAKE2b under a key derived for
        ``label`` alone, so a tag made for one purpose never passes for another)."""
        key = hmac.new(self._key, b"kvt-sign-v1" + label, hashlib.sha256).digest()
        return hashlib.blake2b(data, key=key, digest_size=32).digest()


def _view(frame) -> memoryview:
    return memoryview(getattr(frame, "buffer", frame))  # zmq.Frame (copy=False), bytes or numpy


def _bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _tag(key: bytes, label: bytes, counter: int, frames: Sequence, covered: int | None) -> bytes:
    """A MAC over the frame count, every frame's length and the first ``covered``
    frames' bytes: keyed BLAKE2b-256 (one C object per message; Python's HMAC
    builds several)."""
    h = hashlib.blake2b(label + _COUNTER.pack(counter) + _COUNTER.pack(len(frames)), key=key[:64], digest_size=_TAG)
    for i, f in enumerate(frames):
        v = _view(f)
        h.update(_COUNTER.pack(v.nbytes))
        if covered is None or i < covered:
            h.update(v.cast("B") if v.ndim != 1 or v.format != "B" else v)
    return h.digest()


def refusal_reason(frame) -> str | None:
    """The reason of a ``REFUSED`` frame, or None if ``frame`` is not one."""
    data = _bytes(frame)
    if data[:len(_MAGIC) + 1] not in (_MAGIC + _REFUSED, _OLD_MAGIC + _REFUSED):
        return None
    reason = data[len(_MAGIC) + 1:len(_MAGIC) + 1 + 512].decode("utf-8", "replace")
    if data.startswith(_OLD_MAGIC):
        reason += " (that peer runs an older kvt, authentication protocol kvtA1: run the same kvt on both sides)"
    return reason


class ClientSession:
    """The client's end of one authenticated connection (one socket)."""

    def __init__(self, secret: Secret, covered: int | None = None):
        self._secret, self._covered = secret, covered
        self._cn = os.urandom(_NONCE)
        self._key = self._sid = None
        self.counter = 0

    def hello(self) -> bytes:
        return _MAGIC + _HELLO + self._cn

    def accept(self, frames: Sequence, who: str) -> None:
        """Check the server's CHALLENGE (the last frame of its answer to ``hello``)."""
        last = _bytes(frames[-1]) if frames else b""
        reason = refusal_reason(last)
        if reason is not None:
            raise AuthenticationError(f"{who} refused us: {reason}")
        if len(last) != _CHALLENGE_LEN or not last.startswith(_MAGIC + _CHALLENGE):
            raise AuthenticationError(f"{who} did not answer the authentication challenge (it may have no "
                                      f"auth_key); {_SET_SAME_KEY}")
        sn, tag = last[-_NONCE - _TAG:-_TAG], last[-_TAG:]
        key = self._secret.session_key(self._cn, sn)
        if not hmac.compare_digest(tag, _tag(key, b"server", 0, (), None)):
            raise AuthenticationError(f"{who} could not prove it holds our auth_key; {_SET_SAME_KEY}")
        self._key, self._sid = key, sn

    def seal(self, frames: Sequence) -> bytes:
        """The frame to append to ``frames`` (the next message of this session)."""
        self.counter += 1
        return (_MAGIC + _SEALED + self._cn + self._sid + _COUNTER.pack(self.counter)
                + _tag(self._key, b"req", self.counter, frames, self._covered))

    def open(self, frames: Sequence, who: str) -> list | None:
        """The reply ``frames`` without their auth frame if they answer our
        latest message; None for a late answer to an earlier one.  Raises
        ``AuthenticationError`` for a refusal or a reply that fails its tag."""
        last = _bytes(frames[-1]) if frames else b""
        reason = refusal_reason(last)
        if reason is not None:
            raise AuthenticationError(f"{who} refused our message: {reason}")
        if len(last) != _REPLY_LEN or not last.startswith(_MAGIC + _REPLY):
            raise AuthenticationError(f"{who} sent an unauthenticated reply; {_SET_SAME_KEY}")
        counter = _COUNTER.unpack_from(last, len(_MAGIC) + 1)[0]
        if counter != self.counter:
            return None
        body = list(frames[:-1])
        if not hmac.compare_digest(last[-_TAG:], _tag(self._key, b"rep", counter, body, self._covered)):
            raise AuthenticationError(f"a reply from {who} failed authentication (altered in transit?)")
        return body


class ServerAuth:
    """The server's end: answers HELLOs, checks every other message, seals replies.
    Used by one server thread only.

    Nothing is stored per HELLO: a challenge is a MAC of the client's nonce
    and the time slot under a secret of this server, recomputed when the
    first sealed message comes.  Only a message that passes its tag (a key
    holder's) opens a session, and every challenge that opened one is
    remembered until its slot expired, so replaying a recorded first message
    cannot open a second session."""

    def __init__(self, secret: Secret, covered: int | None = None):
        self._secret, self._covered = secret, covered
        self._mint = os.urandom(32)  # this server's own challenge key; never leaves it
        self._sessions: OrderedDict[bytes, list] = OrderedDict()  # cn | sn -> [session key, last counter]
        self._opened: dict[int, set[bytes]] = {}  # slot -> the sn of every session opened with a challenge of it

    @staticmethod
    def _slot() -> int:
        return int(_now() // _SLOT_S)

    def _sn(self, cn: bytes, slot: int) -> bytes:
        return hashlib.blake2b(cn + _COUNTER.pack(slot), key=self._mint, digest_size=_NONCE).digest()

    def _slot_of(self, cn: bytes, sn: bytes) -> int | None:
        """The slot ``sn`` was issued in for ``cn``: the current or the previous one, else None."""
        now = self._slot()
        for slot in (now, now - 1):
            if hmac.compare_digest(sn, self._sn(cn, slot)):
                return slot
        return None

    def serve(self, frames: list, answer: Callable[[list], list | None],
              refuse: Callable[[list, Exception], list | None] | None) -> list | None:
        """Reply to ``frames`` (a ROUTER message without the identity):
        ``answer`` sees and returns frames exactly as without authentication."""
        env = frames[:1] if frames and _view(frames[0]).nbytes == 0 else []  # a REQ socket's empty delimiter
        body = frames[len(env):]
        last = _bytes(body[-1]) if body and _view(body[-1]).nbytes <= _SEALED_LEN else b""
        if len(body) == 1 and len(last) == _HELLO_LEN and last.startswith(_MAGIC + _HELLO):
            return env + [self._challenge(last[-_NONCE:])]
        try:
            key, counter = self._check(body, last)
        except AuthenticationError as e:
            native = refuse(env + body, e) if refuse is not None else None
            return (native or list(env)) + [_MAGIC + _REFUSED + str(e).encode()[:512]]
        reply = answer(env + body[:-1])
        if reply is None:
            return None
        out = reply[len(env):]
        return reply + [_MAGIC + _REPLY + _COUNTER.pack(counter) + _tag(key, b"rep", counter, out, self._covered)]

    def _challenge(self, cn: bytes) -> bytes:
        sn = self._sn(cn, self._slot())
        return _MAGIC + _CHALLENGE + sn + _tag(self._secret.session_key(cn, sn), b"server", 0, (), None)

    def _check(self, body: list, last: bytes) -> tuple[bytes, int]:
        if last.startswith(_OLD_MAGIC):
            raise AuthenticationError("the peer speaks the authentication protocol of an older kvt (kvtA1); "
                                      "run the same kvt version on both sides")
        if len(body) < 2 or len(last) != _SEALED_LEN or not last.startswith(_MAGIC + _SEALED):
            raise AuthenticationError(f"this agent requires authentication and the message had none; {_SET_SAME_KEY}")
        at = len(_MAGIC) + 1
        sid = last[at:at + 2 * _NONCE]
        counter, tag = _COUNTER.unpack_from(last, at + 2 * _NONCE)[0], last[-_TAG:]
        session = self._sessions.get(sid)
        if session is not None:
            key = session[0]
        else:
            cn, sn = sid[:_NONCE], sid[_NONCE:]
            slot = self._slot_of(cn, sn)
            if slot is None:
                raise AuthenticationError("unknown or expired authentication session; reconnect")
            key = self._secret.session_key(cn, sn)
        if not hmac.compare_digest(tag, _tag(key, b"req", counter, body[:-1], self._covered)):
            raise AuthenticationError(f"message failed authentication (wrong auth_key, or altered); {_SET_SAME_KEY}")
        if session is None:
            session = self._open(sid, slot, key)
        if counter <= session[1]:
            raise AuthenticationError("replayed or reordered message refused")
        session[1] = counter
        self._sessions.move_to_end(sid)
        return key, counter

    def _open(self, sid: bytes, slot: int, key: bytes) -> list:
        """A new session for a challenge of ``slot``, unless that challenge opened one already."""
        now = self._slot()
        for old in [s for s in self._opened if s < now - 1]:  # expired: their sn are refused anyway
            del self._opened[old]
        sn = sid[_NONCE:]
        opened = self._opened.setdefault(slot, set())
        if sn in opened:  # its session was opened (and since dropped): this is a replay, or a stale client
            raise AuthenticationError("replayed message refused (or a session this agent no longer keeps); "
                                      "reconnect")
        if sum(len(x) for x in self._opened.values()) >= _MAX_OPENED:
            raise AuthenticationError(f"more than {_MAX_OPENED} sessions opened in the last "
                                      f"{2 * _SLOT_S:g}s; retry later")
        opened.add(sn)
        session = self._sessions[sid] = [key, 0]
        if len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session


class NotifSeal:
    """Authenticated notifications for backends whose channels kvt does not
    own (nixl, ucx: NIXL/UCX carry them).  ``seal`` prefixes a message with
    ``magic | sender nonce | counter | tag``, the tag binding the sender's and
    receiver's names, the receiver's incarnation (published in its AgentInfo,
    so a message cannot be replayed to a restarted receiver) and the message;
    ``open`` returns the message, or None for anything forged, altered or
    replayed (a sliding window per sender, as IPsec does).

    A sender numbers its messages to each receiver (and receiver
    incarnation) on their own, under a nonce of their own: traffic to other
    peers does not move a receiver's window.  The window is wide
    (``_WINDOW`` messages) because order is not kept: a transfer's
    notification is sealed when it is posted but NIXL sends it when the
    transfer completes, and threads seal and send in any order.  A genuine
    message arriving more than ``_WINDOW`` behind the newest is dropped as
    too old to tell from a replay."""

    OVERHEAD = len(_NOTIF_MAGIC) + 1 + _NONCE + 8 + _TAG
    _WINDOW = 4096  # bits of a Python int per sender: 512 bytes
    _MASK = (1 << _WINDOW) - 1
    _MAX_SENDERS = 4096
    _MAX_RECEIVERS = 4096

    def __init__(self, secret: Secret, me: str):
        # a key of its own, derived from the whole auth_key as every other use's is (the MAC below
        # keys BLAKE2b with at most 64 bytes: the raw key cut there ignored the rest of a long key)
        self._key, self._me = hmac.new(secret._key, b"kvt-notif-key-v2", hashlib.sha256).digest(), me
        self.incarnation = os.urandom(_NONCE)  #: published to peers (``AgentInfo.extra``)
        # (receiver, its incarnation) -> (our nonce for it, its next counter: atomic under the GIL)
        self._outgoing: dict[tuple[str, bytes], tuple[bytes, Callable[[], int]]] = {}
        self._seen: OrderedDict[bytes, list] = OrderedDict()  # sender nonce -> [highest counter, bitmap]

    def _tag(self, sender: str, receiver: str, incarnation: bytes, nonce: bytes, counter: int, msg) -> bytes:
        s, r = sender.encode(), receiver.encode()
        head = _COUNTER.pack(len(s)) + s + _COUNTER.pack(len(r)) + r + incarnation + nonce
        return _tag(self._key, b"kvt-notif-v2" + head, counter, (msg,), None)

    def seal(self, receiver: str, incarnation: bytes, msg: bytes) -> bytes:
        key = (receiver, incarnation)
        out = self._outgoing.get(key)
        if out is None:  # a fresh nonce: the receiver opens a new window for it
            out = self._outgoing.setdefault(key, (os.urandom(_NONCE), iter(range(1, 1 << 63)).__next__))
            while len(self._outgoing) > self._MAX_RECEIVERS:  # the oldest first (a later message to it
                try:                                            # starts over under a new nonce)
                    del self._outgoing[next(iter(self._outgoing))]
                except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                    break
        nonce, counter = out[0], out[1]()
        tag = self._tag(self._me, receiver, incarnation, nonce, counter, msg)
        return _NOTIF_MAGIC + _SEALED + nonce + _COUNTER.pack(counter) + tag + bytes(msg)

    def open(self, sender: str, data: bytes) -> bytes | None:
        n = self.OVERHEAD
        if len(data) < n or not data.startswith(_NOTIF_MAGIC + _SEALED):
            return None
        at = len(_NOTIF_MAGIC) + 1
        nonce, counter, tag = data[at:at + _NONCE], _COUNTER.unpack_from(data, at + _NONCE)[0], data[n - _TAG:n]
        msg = data[n:]
        if not hmac.compare_digest(tag, self._tag(sender, self._me, self.incarnation, nonce, counter, msg)):
            return None
        seen = self._seen.setdefault(nonce, [0, 0])
        self._seen.move_to_end(nonce)
        if len(self._seen) > self._MAX_SENDERS:
            self._seen.popitem(last=False)
        high, bits = seen
        if counter > high:
            shift = counter - high
            seen[0], seen[1] = counter, ((bits << shift) | 1) & self._MASK if shift < self._WINDOW else 1
        elif high - counter >= self._WINDOW or bits >> (high - counter) & 1:
            return None  # replayed, or too old to tell
        else:
            seen[1] = bits | 1 << (high - counter)
        return msg
