"""The user-facing object: one backend, its peers, and block-structured memory.

::

    with Agent(backend="host") as decode:
        decode.register_blocks("kv", kv_caches)            # block-first tensors
        peer = decode.connect("tcp://10.0.0.5:7800")        # handshake + add_remote
        decode.read_blocks(peer, [0, 1, 2], [7, 8, 9]).wait()

Block ids become descriptor indices with one numpy broadcast; each
(peer, layout) pair is prepped once and reused, as NIXL-based engines do.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Mapping, Sequence

import numpy as np

from . import extensions, registry
from .config import Config, load_config
from .auth import NotifSeal, Secret
from .backend import Inbox, seconds as _seconds
from .errors import (AuthenticationError, ClosedError, ConfigError, HandshakeError, IncompatiblePeer,
                     InvalidArgument, InvalidHandle, KvtError, KvtTimeoutError, PeerDisconnected,
                     ServerBusy, TransferTimeout, UnknownPeer, UnsupportedOperation, WireError)
from . import integrity
from .handshake import HandshakeServer, check_bind, request
from .types import Descs, MemKind, Op, PrepHandle, RegHandle, XferHandle, XferState, as_index, is_settled
from .wire import AgentInfo, BlockLayout, HandshakeReply, HandshakeRequest, decode, encode

# the post path (Agent.transfer_blocks, Transfer.state/release) in C; the pure-Python twins below
# run where it is not built, or with KVT_NATIVE=0 (both run the whole test suite)
_fastpath, POST_PATH_REASON = extensions.load("kvt._fastpath", "kvt", "pure-Python post path")
#: ``"native"`` or ``"python"``: which post path ``Agent.transfer_blocks`` takes
POST_PATH = "native" if _fastpath is not None else "python"

__all__ = ["Agent", "Transfer", "Telemetry", "poll_until", "fetch_info"]

log = logging.getLogger(__name__)


def fetch_info(endpoint: str, sender: str, timeout: float, secret: Secret | None = None) -> AgentInfo:
    """A peer's ``AgentInfo`` through its handshake side channel.  Touches no
    backend, so it is safe on a background thread.  ``HandshakeTimeout`` if
    the peer never answers, ``HandshakeError`` if it refuses or sends
    something unreadable, ``AuthenticationError`` if ``secret`` (our
    ``auth_key``) and the peer's differ or one side has none."""
    _seconds(timeout, "handshake timeout")  # NaN, infinity, a string: refused here, not deep in zmq
    reply = decode(request(endpoint, encode(HandshakeRequest(sender=sender)), timeout, secret), HandshakeReply)
    if reply.error:
        cls = AuthenticationError if reply.error.startswith(_AUTH_REFUSAL) else HandshakeError
        raise cls(f"peer at {endpoint} refused the handshake: {reply.error[:_PEER_TEXT]}")
    try:
        return decode(reply.payload, AgentInfo)
    except WireError as e:
        raise HandshakeError(f"peer at {endpoint} sent unreadable metadata: {e}") from e


_PROBE_S = 0.5  # seconds a probe waits for the peer's host to accept a TCP connection


def _unreachable(endpoint: str, timeout: float, hasty: bool = False) -> str | None:
    """Why a TCP ``endpoint`` cannot be a live peer: nothing listens (the
    connection is refused; zmq would retry quietly until the handshake timed
    out) or, ``hasty``, its host did not accept within ``_PROBE_S``.  None
    leaves the judgement to the handshake."""
    scheme, _, where = endpoint.partition("://")
    host, _, port = where.rpartition(":")
    if scheme != "tcp" or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, _PROBE_S)).close()
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"its host did not accept a connection within {min(timeout, _PROBE_S):g}s" if hasty else None
    except (OSError, ValueError, OverflowError):
        pass
    return None


_AUTH_REFUSAL = "AuthenticationError:"
_PEER_TEXT = 512  # characters of a peer's error text we repeat (into errors and logs)
_NOTIF_KEY = "kvt_auth"  # AgentInfo.extra: the incarnation nonce notifications to us are bound to


def _refusal(e: Exception) -> bytes:
    """What the handshake answers a message it cannot serve: a typed refusal, nothing more."""
    return encode(HandshakeReply(error=f"{_AUTH_REFUSAL} {e}" if isinstance(e, AuthenticationError)
                                 else f"ServerBusy: {e}" if isinstance(e, ServerBusy) else "malformed request"))


#: the longest agent or layout name (they travel in every handshake and notification)
MAX_NAME_CHARS = 256


def _peer_name(peer: Any) -> str:
    """``peer`` if it can name a peer; ``UnknownPeer`` otherwise (no peer has such a name)."""
    if not isinstance(peer, str):
        raise UnknownPeer(f"unknown peer {peer!r}: peer names are str (what connect() and add_peer() return)")
    return peer


def _name(value: Any, what: str) -> str:
    """``value`` if it is a usable agent or layout name, else ``InvalidArgument``."""
    try:
        if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS and value.encode():
            return value
    except UnicodeEncodeError:
        pass
    raise InvalidArgument(f"{what} must be text of 1..{MAX_NAME_CHARS} characters (valid UTF-8), "
                          f"got {str(value)[:80]!r}")


def poll_until(check, timeout: float, what: str):
    """Call ``check()`` until it returns something truthy; spin briefly, then
    back off to 1 ms sleeps.  ``KvtTimeoutError`` after ``timeout`` seconds
    (``InvalidArgument`` if that is not a finite number)."""
    timeout = _seconds(timeout, "timeout")
    deadline = time.monotonic() + timeout
    spins, delay = 0, 0.0
    while True:
        out = check()
        if out:
            return out
        now = time.monotonic()
        if now >= deadline:
            raise KvtTimeoutError(f"{what} did not happen within {timeout:g}s")
        spins += 1
        if spins > 100:  # latency-sensitive start, then stop burning the core
            delay = min(0.001, delay * 2 or 2e-5)
            time.sleep(min(delay, deadline - now))


def _in_thread(loop, fn, *args):
    """``fn(*args)`` on a thread of its own, as a future of ``loop``.  Not the
    loop's executor: a wait on a silent peer may take its whole timeout, and
    that pool has a few threads the rest of the program needs."""
    fut = loop.create_future()

    def run():
        try:
            out, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            out, exc = None, e
        try:
            loop.call_soon_threadsafe(_resolve, fut, out, exc)
        except RuntimeError:  # the loop is closed: nobody awaits it any more
            pass

    threading.Thread(target=run, name="kvt-await", daemon=True).start()
    return fut


def _resolve(fut, out, exc) -> None:
    if not fut.done():  # cancelled meanwhile: the outcome is nobody's
        if exc is None:
            fut.set_result(out)
        else:
            fut.set_exception(exc)


_PROC = XferState.PROC.status
_DONE_STATE = XferState.DONE

#: transfer failures that mean the peer may have gone (and may come back as a new process)
_PEER_LOST = (PeerDisconnected, TransferTimeout)
_RECOVER_TIMEOUT = 2.0  # seconds an attempt may spend asking a lost peer for new metadata
_RECOVER_WAIT = 0.1     # seconds a post or wait on a lost peer waits for an attempt (a restart nearby: ms)
_BACKOFF = (0.1, 1.0)   # seconds from a failed attempt to the next on a peer that stays lost: first, cap
_MAX_ATTEMPTS = 4       # attempts (threads) at once per agent: many peers lost together are looked for in turns


@dataclass(frozen=True, slots=True)
class Telemetry:
    """What one transfer cost, as ``Transfer.telemetry`` reports it (like
    NIXL's ``get_xfer_telemetry``)."""

    nbytes: int          #: bytes moved
    descs: int           #: descriptors (block x region pairs) posted
    post_s: float        #: seconds inside the post call (``transfer_blocks`` to the backend's return)
    xfer_s: float | None  #: seconds from the post to completion first seen (None while pending)


class _PyTransferCore:
    """Transfer's fields, ``state()``, ``release()`` and finalizer: the
    pure-Python twin of ``kvt._fastpath.TransferCore``."""

    __slots__ = ("_agent", "_backend", "handle", "nbytes", "descs", "peer", "verify",
                 "_t0", "_t1", "_t2", "_live", "_settled")

    def __init__(self, agent: "Agent", handle: XferHandle, nbytes: int, descs: int = 0, t0: int | None = None,
                 peer: str | None = None):
        # built once per request: plain stores, no calls but the clock
        self._t1 = t1 = perf_counter_ns()
        self._t0 = t1 if t0 is None else t0
        self._agent, self._backend, self.handle, self.nbytes, self.descs = agent, agent.backend, handle, nbytes, descs
        self.peer = peer
        #: with integrity checks on: proves the landed bytes once DONE (raises IntegrityError)
        self.verify = None
        # the backend answered SETTLED (done at post): nothing to ask it or release
        self._settled = is_settled(handle)
        self._t2: int | None = t1 if self._settled else None
        self._live = [True]  # emptied by the one release that frees the handle (list.pop is atomic)

    def state(self) -> XferState:
        if not self._live:
            raise InvalidHandle(f"transfer {self.handle} was released; its state is gone (telemetry stays)")
        if self._settled:
            return _DONE_STATE
        s = self._backend.check_state(self.handle)
        if self._t2 is None and s.status is not _PROC:
            self._t2 = perf_counter_ns()
        return s

    def release(self) -> None:
        """Free the handle.  Releasing a transfer in flight stops it where the
        backend can, else waits for its posted bytes (bounded by the backend's
        timeout).  Idempotent for this object, and nothing to do once the
        agent is closed (``close`` released every handle)."""
        try:
            self._live.pop()  # one thread wins; a concurrent second release finds it empty
        except IndexError:
            return
        if self._settled or self._agent._closed:
            return
        try:
            self._backend.release(self.handle)
        except ClosedError:  # closed meanwhile: close released it
            pass

    def __del__(self):
        # dropped unreleased (``read_blocks(...).wait()``, ``await read_blocks(...)``): the
        # agent releases it on its next post; never from here, since a finalizer may run
        # inside a backend call that holds the backend's lock
        try:
            if self._live and not self._settled and not self._agent._closed:
                self._agent._orphans.append(self.handle)
        except AttributeError:  # half-built, or torn down at interpreter exit
            pass


_TransferCore = _PyTransferCore if _fastpath is None else _fastpath.TransferCore


class Transfer(_TransferCore):
    """A posted transfer: poll with ``state()``, block with ``wait()``, or
    ``await`` it from a coroutine.  ``release()`` it (or use it as a context
    manager); one dropped unreleased is released by its agent later."""

    __slots__ = ()

    def wait(self, timeout: float | None = None) -> None:
        """Until ``DONE``; raises the ``TransferError`` cause on ``ERR``,
        ``KvtTimeoutError`` after ``timeout`` seconds (default:
        transfer_timeout + 5; 0 looks once; NaN, infinity or a non-number:
        ``InvalidArgument``).  Blocks on the backend's completion event where
        it has one.  A failure that looks like the peer went away first starts
        an attempt to reconnect it (``Agent.reconnect``) and waits for it
        0.1 s at most, so the next transfer reaches a peer that restarted
        meanwhile."""
        t = self._agent.config.transfer_timeout + 5 if timeout is None else _seconds(timeout, "wait timeout")
        state = self.state()
        if state.pending:
            state = self._backend.wait(self.handle, t)
            if state.pending:
                raise KvtTimeoutError(f"transfer {self.handle} ({self.nbytes} bytes) did not happen within {t:g}s")
            self._t2 = perf_counter_ns()
        if state.failed:
            if isinstance(state.cause, _PEER_LOST) and self.peer is not None:
                self._agent._recover(self.peer)
                self._agent._check_moved(self.peer, state.cause)
            # one stored cause, raised by every wait: each raise would add its frames to the last
            raise state.cause.with_traceback(None)
        if self.verify is not None:
            self.verify()

    def __await__(self):
        """``await transfer``: ``wait()`` on a thread, so the event loop runs
        meanwhile.  Cancelled (``task.cancel()``, ``asyncio.wait_for``), the
        transfer is released before the cancellation reaches the caller, so
        none of its bytes land after it."""
        if self.state().done and self.verify is None:
            return  # settled already: no thread
        yield from self._wait_async().__await__()

    async def _wait_async(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        try:
            await _in_thread(loop, self.wait)
        except asyncio.CancelledError:
            # shielded: a second cancellation must not leave the release half done
            await asyncio.shield(_in_thread(loop, self._release_quietly))
            raise

    @property
    def telemetry(self) -> Telemetry:
        return Telemetry(self.nbytes, self.descs, (self._t1 - self._t0) / 1e9,
                         None if self._t2 is None else (self._t2 - self._t1) / 1e9)

    def _release_quietly(self) -> None:
        try:
            self.release()
        except KvtError as e:  # the caller sees its cancellation; this is only worth a log line
            log.debug("releasing cancelled transfer %s: %s", self.handle, e)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _PyRouteCore:
    __slots__ = ("lprep", "rprep", "block_len", "nblocks", "rnblocks", "lregions", "rregions")


class _PyAgentCore:
    """The fields of Agent that its post path reads: the pure-Python twin
    of ``kvt._fastpath.AgentCore`` (whose ``transfer_blocks`` takes the
    common case in C and hands the rest to ``Agent._transfer_blocks``)."""

    __slots__ = ("backend", "_routes", "_lost", "_orphans", "_notif_seal", "_closed", "_integrity")


if _fastpath is None:
    _RouteCore, _AgentCore = _PyRouteCore, _PyAgentCore
else:
    _RouteCore, _AgentCore = _fastpath.RouteCore, _fastpath.AgentCore


class _Route(_RouteCore):
    """A checked (peer, local layout, remote layout) pairing with both sides
    prepped: what every transfer between them reuses."""

    __slots__ = ()

    def __init__(self, lprep: PrepHandle, rprep: PrepHandle, mine: BlockLayout, theirs: BlockLayout):
        self.lprep, self.rprep, self.block_len, self.nblocks = lprep, rprep, mine.block_len, mine.num_blocks
        self.rnblocks = theirs.num_blocks
        self.lregions = _region_offsets(mine)
        self.rregions = _region_offsets(theirs)


def _region_offsets(layout: BlockLayout) -> np.ndarray | None:
    """Descriptor index of block 0 in each region, as a column (None for one region)."""
    n = len(layout.base_addrs)
    return None if n == 1 else (np.arange(n, dtype=np.int64) * layout.num_blocks)[:, None]


class Agent(_AgentCore):
    """One backend plus its peers.  ``backend``/``options`` override the
    configuration (``KVT_BACKEND``, ``KVT_CONFIG``); ``config`` replaces it."""

    def __init__(self, name: str | None = None, backend: str | None = None,
                 options: Mapping[str, Any] | None = None, *, config: Config | None = None):
        if config is not None and not isinstance(config, Config):
            raise ConfigError(f"config must be a kvt.Config, got {type(config).__name__}; pass the result of "
                              "kvt.load_config(...) (e.g. kvt.load_config(**settings) for a dict of settings)")
        self.config = config or load_config(backend=backend, options=options)
        self.name = _name(name or self.config.name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
                          "an agent name")
        self.backend_name = self.config.backend
        #: the shared ``auth_key`` every peer must prove (kvt.auth), or None
        self.secret = None if self.config.auth_key is None else Secret(self.config.auth_key)
        options = self.config.options
        #: seals notifications on backends whose channels kvt does not own (nixl, ucx)
        self._notif_seal: NotifSeal | None = None
        if self.secret is not None:
            if registry.load_backend(self.backend_name, self.config.backend_source).uses_auth_key:
                options = {**options, "auth_key": self.secret}
            else:
                self._notif_seal = NotifSeal(self.secret, self.name)
        self.backend = registry.create_backend(self.backend_name, self.name, options,
                                               shared=self.config.shared_options,
                                               chosen_by=self.config.backend_source)
        self.extra: dict[str, Any] = {}  #: published in AgentInfo (the connector's compatibility fields)
        self._layouts: dict[str, BlockLayout] = {}
        self._layout_regs: dict[str, RegHandle] = {}
        self._peers: dict[str, AgentInfo] = {}
        self._preps: dict[tuple[str | None, str], PrepHandle] = {}
        self._routes: dict[tuple[str, str, str], _Route] = {}  # (peer, layout, remote layout) -> checked, prepped
        self._orphans: list[XferHandle] = []  # transfers dropped unreleased (Transfer.__del__), freed on a post
        # what wait_notif received while looking for another message, bounded as a backend's inbox
        self._pending = Inbox()
        self._reach: dict[str, str] = {}  # peer -> how connect() reached it (endpoint or discovery name)
        self._lost: dict[str, float] = {}  # peer -> when the next attempt on it may start (it is still gone)
        self._backoff: dict[str, float] = {}  # peer -> the pause before that attempt
        self._recovering: dict[str, threading.Event] = {}  # peer -> set when the attempt on it now ends
        self._attempt_slots = threading.BoundedSemaphore(_MAX_ATTEMPTS)  # one per attempt running
        self._moved: dict[str, str] = {}  # peer -> why it is gone for good (its route leads to another agent)
        self._discovery = None
        self._lock = threading.RLock()
        # loading or removing a peer can wait on the backend (host waits out the peer's copies): it
        # holds only its peer's stripe, so calls about other peers and notifications go on meanwhile
        # one lock per peer name, alive while in use (a lock shared by two names made a reload waiting
        # on one peer's busy lane hold up loading the other: 1 in 16 pairs of names, with stripes)
        self._peer_locks: weakref.WeakValueDictionary[str, threading.RLock] = weakref.WeakValueDictionary()
        self._peer_locks_guard = threading.Lock()
        self._notif_lock = threading.Lock()
        self._close_lock = threading.Lock()  # a second close() returns once the first is done
        self._server: HandshakeServer | None = None
        self._integrity = bool(self.config.integrity)  # (the post path's copy of the setting)
        self._closed = False

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Any, kind: MemKind | str | None = None) -> RegHandle:
        """Register torch tensors, numpy arrays, ``Descs`` or (addr, len, dev) rows."""
        self._check_open()
        return self.backend.register(Descs.coerce(mem, kind))

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        self.backend.deregister(handle)

    def register_blocks(self, layout: str, buffers: Sequence[Any], *,
                        kind: MemKind | str | None = None) -> BlockLayout:
        """Register block-first buffers (shape ``(num_blocks, ...)``, e.g. one
        per layer, or per K and V) as the named layout peers address by block id.
        Re-registering a layout replaces it."""
        self._check_open()
        _name(layout, "a layout name")
        if isinstance(buffers, (str, bytes)) or not hasattr(buffers, "__iter__"):
            raise InvalidArgument(f"register_blocks takes a list of block-first buffers, got {type(buffers).__name__}")
        buffers = list(buffers)
        if not buffers:
            raise InvalidArgument("register_blocks needs at least one buffer")
        # first: it refuses what is no plain buffer (a sparse tensor, numpy as device memory) with its reason
        descs = Descs.from_buffers(buffers, kind)
        if any(len(getattr(b, "shape", ())) < 1 or b.shape[0] < 1 for b in buffers) or not descs.lengths.all():
            raise InvalidArgument("register_blocks takes block-first buffers with at least one block of at least "
                                  f"one byte (shape (num_blocks, ...)), got shapes "
                                  f"{[tuple(getattr(b, 'shape', ())) for b in buffers][:4]}")
        nblocks = {int(b.shape[0]) for b in buffers}
        if len(nblocks) != 1 or len(set(descs.lengths.tolist())) != 1 or len(set(descs.devices.tolist())) != 1:
            raise InvalidArgument("every buffer of a layout needs the same shape, dtype and device "
                                  f"(got first dims {sorted(nblocks)}, sizes {sorted(set(descs.lengths.tolist()))})")
        num_blocks = nblocks.pop()
        block_len = int(descs.lengths[0]) // max(num_blocks, 1)
        with self._lock:
            old = self._layout_regs.get(layout)
            if old is not None:
                # preps first: a transfer posted meanwhile then finds its route gone and takes the new
                # one, rather than a prep of memory that is no longer registered
                self._drop_preps(lambda peer, name: name == layout and peer is None)
            # the new registration before the old goes: memory in both (the same buffers registered
            # again) stays registered throughout, so transfers of it run on (deregister stops only
            # those of memory no registration holds any more)
            self._layout_regs[layout] = self.backend.register(descs)
            if old is not None:
                self.backend.deregister(old)
            self._layouts[layout] = BlockLayout(base_addrs=descs.addrs.tolist(), block_len=block_len,
                                                num_blocks=num_blocks, stride=block_len,
                                                device=int(descs.devices[0]), kind=descs.kind.value)
            return self._layouts[layout]

    @property
    def layouts(self) -> dict[str, BlockLayout]:
        return dict(self._layouts)

    # -- peers ----------------------------------------------------------------

    def info(self) -> AgentInfo:
        """What a peer needs to reach us (sent by the handshake)."""
        self._check_open()
        extra = dict(self.extra)
        if self._notif_seal is not None:  # senders bind their notifications to this incarnation of us
            extra[_NOTIF_KEY] = self._notif_seal.incarnation.hex()
        return AgentInfo(name=self.name, backend=self.backend_name, metadata=self.backend.local_metadata(),
                         layouts=dict(self._layouts), extra=extra)

    def listen(self, host: str | None = None, port: int | None = None) -> str:
        """Serve our ``AgentInfo`` on the handshake side channel; returns its endpoint."""
        self._check_open()
        host, port = check_bind(self.config.listen_host if host is None else host,
                                self.config.listen_port if port is None else port)  # refused even when listening
        if self._server is None:
            self._server = HandshakeServer(self._answer, host, port, refuse=_refusal, secret=self.secret).start()
        return self._server.endpoint

    @property
    def endpoint(self) -> str | None:
        return self._server.endpoint if self._server else None

    def _answer(self, body: bytes) -> bytes:
        try:
            try:
                decode(body, HandshakeRequest)
            except WireError:
                return encode(HandshakeReply(payload=self._digest(decode(body, integrity.DigestRequest))))
            return encode(HandshakeReply(payload=encode(self.info())))
        except KvtError as e:
            return encode(HandshakeReply(error=f"{type(e).__name__}: {e}"))

    def _digest(self, req: "integrity.DigestRequest") -> bytes:
        if not self.config.integrity:  # nobody needs our digests: answer none (they cost us, not the asker)
            raise UnsupportedOperation(f"integrity checks are off on agent {self.name!r}; digests are served "
                                       "only with KVT_INTEGRITY=1 (set it on both sides)")
        if len(req.block_ids) % 8:
            raise WireError(f"digest request of {len(req.block_ids)} bytes of block ids is not int64s")
        layout = req.of(self._layout(None, req.layout))
        integrity.check_request(layout, len(req.block_ids) // 8)
        return integrity.digest(layout, np.frombuffer(req.block_ids, np.int64)).tobytes()

    def _verify(self, op: Op, peer: str, layout: str, rlayout: str, local_ids, remote_ids) -> None:
        """Digest what we hold of the transfer, ask the peer for its side's, compare."""
        mine, theirs = self._layouts[layout], self._layout(peer, rlayout)
        if op is Op.READ:
            integrity.maybe_flip(mine, local_ids)
        n = mine.num_blocks if local_ids is None else len(local_ids)
        what = f"{op.value} of {n} blocks {'from' if op is Op.READ else 'to'} peer {peer!r}"
        route = self._reach.get(peer)

        def ask(ids: np.ndarray) -> np.ndarray:
            if route is None:  # removed meanwhile: unverified, so failed
                raise UnknownPeer(f"peer {peer!r} was removed before its digests were asked for")
            return self.ask_digests(route, integrity.DigestRequest(layout=rlayout, block_ids=ids.tobytes()))

        integrity.verify(mine, local_ids, theirs, remote_ids, ask, what)

    def ask_digests(self, endpoint: str, req: "integrity.DigestRequest") -> np.ndarray:
        """The digests (uint64, one per region) the agent at ``endpoint`` (or
        published under that name) answers ``req`` with: one side-channel round
        trip within ``handshake_timeout`` (``kvt.integrity``).  Its refusal is a
        ``HandshakeError``, unreadable digests a ``WireError``."""
        if "://" not in endpoint:
            endpoint = self.discovery.resolve(endpoint)
        reply = decode(request(endpoint, encode(req), self.config.handshake_timeout, self.secret), HandshakeReply)
        if reply.error:
            raise HandshakeError(reply.error[:_PEER_TEXT])
        if len(reply.payload) % 8:
            raise WireError(f"{len(reply.payload)} bytes of digests is not a whole number of uint64s")
        return np.frombuffer(reply.payload, np.uint64)

    def connect(self, endpoint: str, timeout: float | None = None) -> str:
        """Fetch a peer's ``AgentInfo`` through its side channel and load it.
        Returns the peer's name.  ``HandshakeTimeout`` if it never answers.

        ``endpoint`` is ``tcp://host:port``, or a name another agent
        ``publish``-ed in the discovery store (``KVT_DISCOVERY``).  kvt
        remembers it: when waiting on a transfer to the peer finds it failed as
        if the peer had gone (``PeerDisconnected``, ``TransferTimeout``), kvt
        reconnects the same way, and while it stays gone the next transfer to
        it tries again first (each attempt on a thread of kvt's, waited for
        0.1 s at most; after one that failed, a pause of 0.1 s, doubling to
        1 s while the peer stays gone), so a restarted peer is picked up
        with no call from the user, if it kept its agent name (a configured
        ``name``; one drawn at start changes with each restart).  Once the
        route leads to an agent of another name, transfers to the old name
        fail at once with ``PeerDisconnected`` saying to ``connect()`` again."""
        self._check_open()
        if not isinstance(endpoint, str):
            raise InvalidArgument(f"connect takes an endpoint 'tcp://host:port' or a published name (a str), "
                                  f"got {type(endpoint).__name__}")
        info = self._fetch(endpoint, timeout)
        with self._peer_lock(info.name):  # loaded and reachable together: a remove_peer undoes both
            name = self.add_peer(info)
            self._reach[name] = endpoint
        return name

    def _peer_lock(self, name: str) -> threading.RLock:
        """The lock that orders loading, reloading and removing ``name``."""
        with self._peer_locks_guard:
            lock = self._peer_locks.get(name)
            if lock is None:
                lock = self._peer_locks[name] = threading.RLock()
            return lock

    def _fetch(self, route: str, timeout: float | None, probe: bool = False, hasty: bool = False) -> AgentInfo:
        """``probe``: first see whether anything listens there (a process
        that died leaves a port that refuses at once, where the handshake
        would wait out its whole timeout); ``hasty``: and give up on a host
        that does not accept the probe's connection in time."""
        t = self.config.handshake_timeout if timeout is None else timeout
        _seconds(t, "handshake timeout")
        if "://" not in route:
            route = self.discovery.resolve(route, timeout=t)
        why = _unreachable(route, t, hasty) if probe else None
        if why:
            raise HandshakeError(f"no live peer at {route} ({why})")
        return fetch_info(route, self.name, t, self.secret)

    def reconnect(self, peer: str, timeout: float | None = None) -> bool:
        """Fetch ``peer``'s metadata again the way ``connect`` first reached it
        and reload it (a restarted peer: the old incarnation's state is
        dropped, its in-flight transfers end ``ERR``).  True if it changed.  ``PeerDisconnected`` if the peer is not back (yet).
        Called by ``Transfer.wait`` on a lost peer; call it yourself when you
        poll with ``state()``."""
        return self._reconnect(peer, timeout)

    def _reconnect(self, peer: str, timeout: float | None, hasty: bool = False) -> bool:
        self._check_open()
        if timeout is not None:
            _seconds(timeout, "handshake timeout")  # a bad argument, not a lost peer
        route = self._reach.get(_peer_name(peer))
        if route is None:
            raise PeerDisconnected(f"peer {peer!r} seems gone and was added by add_peer(), so kvt cannot "
                                   "reach it again by itself; connect() to it again")
        try:
            info = self._fetch(route, timeout, probe=True, hasty=hasty)
        except KvtError as e:
            raise PeerDisconnected(f"peer {peer!r} seems gone and does not answer at {route} ({e}); "
                                   "the next transfer tries again") from e
        if info.name != peer:
            raise IncompatiblePeer(
                f"peer {peer!r} is gone: {route} now leads to agent {info.name!r} (a restart under a new name: "
                f"an agent's name is drawn anew at each start unless configured); connect({route!r}) again to "
                "reach it, or give that agent a fixed `name` so kvt reconnects by itself")
        with self._peer_lock(peer):
            now = self._reach.get(peer)
            if now is None:  # removed while we fetched: it stays removed
                raise PeerDisconnected(f"peer {peer!r} was removed while reconnecting; connect() to it again")
            if now != route:  # connect() reloaded it from elsewhere meanwhile
                return True
            old = self._peers.get(peer)
            # reloaded even when unchanged: a backend that gave up on a silent peer (frozen, or
            # cut off for a while) counts it as reachable again
            self.add_peer(info)
            return old is None or old.metadata != info.metadata or old.layouts != info.layouts

    def _recover(self, peer: str, lost_only: bool = False) -> None:
        """Look for a lost peer's new incarnation on a thread of its own, and
        wait for it ``_RECOVER_WAIT`` at most: a peer restarted nearby answers
        within it, so the caller's next transfer reaches the new process,
        while a host that does not answer or a frozen process costs each
        caller that long, not the attempt's 0.5-2 s.  One attempt per peer at
        a time (the waits of a batch of failed transfers share it), and a
        pause after one that failed, doubling while the peer stays gone: a
        call within ``_RECOVER_WAIT`` of its end waits for it, an earlier one
        returns at once (its transfer fails fast).  At most ``_MAX_ATTEMPTS``
        attempts run at once: past that a call returns at once too, and the
        peer's attempt waits for a later call.  ``lost_only``: nothing for a
        peer not marked lost (a post; a failed transfer's wait marks it)."""
        if peer not in self._reach or peer in self._moved or self._closed:
            return
        now, due = time.monotonic(), self._lost.get(peer)
        if due is None:
            if lost_only:  # (found again meanwhile, or a healthy peer while another is lost)
                return
            due = -math.inf
        deadline = now + _RECOVER_WAIT
        if due > deadline:
            return
        done = self._recovering.get(peer)
        if done is None:
            if due > now:
                time.sleep(max(0.0, due - time.monotonic()))
            if not self._attempt_slots.acquire(blocking=False):  # other peers are being looked for
                self._lost.setdefault(peer, now)  # due: a later call (a post too) makes the attempt
                return
            mine = threading.Event()
            done = self._recovering.setdefault(peer, mine)  # (atomic: one caller makes the attempt)
            if done is not mine:
                self._attempt_slots.release()
            else:
                self._lost[peer] = time.monotonic()  # posts meanwhile wait for it too
                try:
                    threading.Thread(target=self._attempt, args=(peer, mine), name=f"kvt-recover-{peer}",
                                     daemon=True).start()
                except RuntimeError as e:  # no thread to be had (a process at its limit): on a later call
                    log.warning("no thread to look for lost peer %r: %s", peer, e)
                    self._attempt_ended(peer, mine)
                    return
        done.wait(max(0.0, deadline - time.monotonic()))

    def _attempt(self, peer: str, done: threading.Event) -> None:
        try:
            self._reconnect(peer, min(self.config.handshake_timeout, _RECOVER_TIMEOUT), hasty=True)
            self._lost.pop(peer, None)  # (add_peer did, unless a connect() reloaded it meanwhile)
            self._backoff.pop(peer, None)
        except Exception as e:  # still gone: the callers see their transfers' own errors
            if not isinstance(e, KvtError):
                log.warning("looking for a new incarnation of peer %r failed: %r", peer, e)
            with self._peer_lock(peer):
                if peer in self._reach:  # (not if it was removed meanwhile)
                    pause = min(self._backoff.get(peer, _BACKOFF[0] / 2) * 2, _BACKOFF[1])
                    self._backoff[peer] = pause
                    self._lost[peer] = time.monotonic() + pause
                    if isinstance(e, IncompatiblePeer):  # gone for good: no more attempts
                        self._moved[peer] = str(e)
                else:
                    self._lost.pop(peer, None)
        finally:
            self._attempt_ended(peer, done)

    def _attempt_ended(self, peer: str, done: threading.Event) -> None:
        self._recovering.pop(peer, None)
        self._attempt_slots.release()
        done.set()

    def _check_moved(self, peer: str, cause: BaseException | None = None) -> None:
        """``PeerDisconnected`` saying what to do if ``peer`` restarted under another name."""
        why = self._moved.get(peer)
        if why is not None:
            raise PeerDisconnected(why) from cause

    @property
    def discovery(self):
        """The discovery store named by ``KVT_DISCOVERY`` / the ``discovery``
        setting (``ConfigError`` if none is configured)."""
        if self._discovery is None:
            from .discovery import open_store
            self._discovery = open_store(self.config.discovery)
        return self._discovery

    def publish(self, name: str | None = None, ttl: float | None = None) -> None:
        """Publish our side-channel endpoint in the discovery store under
        ``name`` (default: our agent name) with a lease of ``ttl`` seconds,
        kept alive while we run; a peer then ``connect(name)``-s.  Starts the
        side channel if needed."""
        endpoint = self.endpoint or self.listen()
        self.discovery.publish(name or self.name, endpoint, ttl)

    def add_peer(self, info: AgentInfo | bytes) -> str:
        """Load a peer's ``AgentInfo`` (re-adding refreshes it)."""
        self._check_open()
        if not isinstance(info, AgentInfo):
            info = decode(info, AgentInfo)
        if info.backend != self.backend_name:
            raise IncompatiblePeer(f"peer {info.name!r} uses backend {info.backend!r}, we use "
                                   f"{self.backend_name!r}; configure both sides with the same backend")
        with self._peer_lock(info.name):
            self._check_open()  # again under the lock: close() waits for the loads of its own attempts
            with self._lock:  # posts meanwhile build their route again, in _route, after the reload
                self._drop_preps(lambda peer, _: peer == info.name)
            name = self.backend.add_remote(info.metadata)
            with self._lock:
                self._drop_preps(lambda peer, _: peer == name)
                self._peers[name] = info
                self._lost.pop(name, None)  # fresh metadata: not lost (nor gone for good) any more
                self._backoff.pop(name, None)
                self._moved.pop(name, None)
        return name

    def remove_peer(self, peer: str) -> None:
        self._check_open()
        _peer_name(peer)
        with self._peer_lock(peer):
            with self._lock:
                self._drop_preps(lambda p, _: p == peer)
                self._peers.pop(peer, None)
                self._reach.pop(peer, None)
                self._lost.pop(peer, None)
                self._backoff.pop(peer, None)
                self._moved.pop(peer, None)
            self.backend.remove_remote(peer)

    def peer_info(self, peer: str) -> AgentInfo:
        try:
            return self._peers[peer]
        except (KeyError, TypeError):  # (an unhashable name: no peer's either)
            raise UnknownPeer(f"unknown peer {peer!r}; connect() or add_peer() first "
                              f"(known: {sorted(self._peers) or 'none'})") from None

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # -- block transfers ------------------------------------------------------

    def read_blocks(self, peer: str, local_ids: Any, remote_ids: Any, layout: str = "kv",
                    notif: bytes | None = None, remote_layout: str | None = None) -> Transfer:
        """Pull the peer's ``remote_ids`` blocks into our ``local_ids`` blocks."""
        return self.transfer_blocks(Op.READ, peer, local_ids, remote_ids, layout, notif, remote_layout)

    def write_blocks(self, peer: str, local_ids: Any, remote_ids: Any, layout: str = "kv",
                     notif: bytes | None = None, remote_layout: str | None = None) -> Transfer:
        """Push our ``local_ids`` blocks into the peer's ``remote_ids`` blocks."""
        return self.transfer_blocks(Op.WRITE, peer, local_ids, remote_ids, layout, notif, remote_layout)

    def _transfer_blocks(self, op: Op, peer: str, local_ids: Any, remote_ids: Any, layout: str = "kv",
                         notif: bytes | None = None, remote_layout: str | None = None) -> Transfer:
        """``op`` (READ pulls, WRITE pushes) between our ``local_ids`` blocks of
        ``layout`` and the peer's ``remote_ids`` blocks of ``remote_layout``
        (default: the same name); ``notif`` reaches the peer after the bytes."""
        # Agent.transfer_blocks: this, or kvt._fastpath's C method, which takes the common case
        # and hands every other call here
        t0 = perf_counter_ns()
        if self._closed:
            self._check_open()
        if self._orphans:
            self._reap()
        if self._lost and type(peer) is str:
            self._check_moved(peer)
            self._recover(peer, lost_only=True)  # a transfer to a lost peer would fail: first look for it
            self._check_moved(peer)
        rname = remote_layout or layout
        key = (peer, layout, rname)
        try:
            route = self._routes.get(key)
        except TypeError:  # an unhashable peer or layout name: nobody's
            raise InvalidArgument(f"peer and layout names are str, got {peer!r}, {layout!r}") from None
        route = route or self._route(peer, layout, rname)
        try:
            h, n = self._post(op, route, local_ids, remote_ids,
                              notif if notif is None or self._notif_seal is None else self._seal(peer, notif))
        except InvalidHandle as e:
            h, n, route = self._repost(e, op, key, route, local_ids, remote_ids, notif)
        t = Transfer(self, h, n * route.block_len, n, t0, peer)
        if self.config.integrity:
            t.verify = lambda: self._verify(Op(op), peer, layout, rname, local_ids, remote_ids)
        return t

    def _post(self, op: Op, route: _Route, local_ids: Any, remote_ids: Any, notif: bytes | None):
        """The backend's handle and the number of descriptors posted."""
        if route.lregions is None:  # one region: block ids are the indices, and the backend checks them
            lidx, ridx = local_ids, remote_ids
            try:
                n = route.nblocks if local_ids is None else len(local_ids)
            except TypeError:  # a scalar or a generator (a layout of several regions says the same)
                raise InvalidArgument(f"block ids must be a 1-D sequence of ints, got {type(local_ids).__name__}") \
                    from None
        else:
            lidx = (route.lregions + as_index(local_ids, route.nblocks, "block ids")).ravel()
            ridx = (route.rregions + as_index(remote_ids, route.rnblocks, "block ids")).ravel()
            n = lidx.size
        return self.backend.transfer(op, route.lprep, lidx, route.rprep, ridx, notif), n

    def _repost(self, err: InvalidHandle, op: Op, key: tuple[str, str, str], route: _Route, local_ids, remote_ids,
                notif):
        """``err``: a prep of ``route`` was released under the post.  If
        another thread's ``add_peer``/``reconnect``, ``register_blocks`` or
        ``remove_peer`` replaced the route meanwhile, post again on the
        current one (a removed peer then raises ``UnknownPeer``)."""
        for _ in range(10):
            self._check_open()
            if self._routes.get(key) is route:
                raise err  # the route is current: not a race, the caller's error
            route = self._routes.get(key) or self._route(*key)
            # sealed again: the peer may be a new incarnation now
            sealed = notif if notif is None or self._notif_seal is None else self._seal(key[0], notif)
            try:
                return (*self._post(op, route, local_ids, remote_ids, sealed), route)
            except InvalidHandle as e:
                err = e
        raise InvalidHandle(f"the route to peer {key[0]!r} kept being replaced while posting ({err}); "
                            "do not re-add the peer or its layout in a loop while transferring")

    def _route(self, peer: str, layout: str, rname: str) -> _Route:
        """Check and prep a layout pairing once; transfers then reuse it."""
        # layouts and preps read together: add_peer (under the peer's lock: never half reloaded) or
        # register_blocks may replace them
        with self._peer_lock(peer), self._lock:
            mine, theirs = self._layout(None, layout), self._layout(peer, rname)
            if mine.block_len != theirs.block_len or len(mine.base_addrs) != len(theirs.base_addrs):
                raise IncompatiblePeer(
                    f"layout {layout!r} ({len(mine.base_addrs)} regions x {mine.block_len} B blocks) does not "
                    f"match peer {peer!r}'s {rname!r} ({len(theirs.base_addrs)} x {theirs.block_len} B)")
            if self.config.integrity and peer not in self._reach:
                raise UnsupportedOperation(f"integrity checks ask the peer for its digests through its side "
                                           f"channel: connect() to {peer!r} rather than add_peer()")
            route = _Route(self._prep(None, layout), self._prep(peer, rname), mine, theirs)
            self._routes[(peer, layout, rname)] = route
        return route

    def _reap(self) -> None:
        """Release the transfers dropped unreleased that have settled; the
        rest wait for a later post."""
        pending = []
        while self._orphans:
            try:
                h = self._orphans.pop()
            except IndexError:  # another thread took the last one
                break
            try:
                if self.backend.check_state(h).pending:
                    pending.append(h)
                else:
                    self.backend.release(h)
            except KvtError:  # released or closed meanwhile
                pass
        self._orphans.extend(pending)

    @staticmethod
    def block_index(layout: BlockLayout, block_ids: Any) -> np.ndarray:
        """Descriptor indices of ``block_ids`` in every region (region-major)."""
        if _fastpath is not None:  # a list of ints in range, in one C call (see kvt/_fastpath.c)
            out = _fastpath.block_index(block_ids, layout.num_blocks, len(layout.base_addrs))
            if out is not None:
                return out
        ids = as_index(block_ids, layout.num_blocks, "block ids")
        regions = _region_offsets(layout)
        return ids if regions is None else (regions + ids).ravel()

    def _layout(self, peer: str | None, name: str) -> BlockLayout:
        layouts = self._layouts if peer is None else self.peer_info(peer).layouts
        try:
            return layouts[name]
        except KeyError:
            who = "this agent" if peer is None else f"peer {peer!r}"
            raise InvalidArgument(f"{who} has no block layout {name!r} (has {sorted(layouts) or 'none'}); "
                                  "register_blocks() it first") from None

    def _prep(self, peer: str | None, layout: str) -> PrepHandle:
        key = (peer, layout)
        with self._lock:
            h = self._preps.get(key)
            if h is None:
                h = self._preps[key] = self.backend.prep(peer, self._layout(peer, layout).descs())
            return h

    def _drop_preps(self, match) -> None:
        self._routes.clear()  # rebuilt on next use from the preps that remain
        for key in [k for k in self._preps if match(*k)]:
            self.backend.release(self._preps.pop(key))

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self.backend.notify(_peer_name(peer), msg if self._notif_seal is None else self._seal(peer, msg))

    def notif_for(self, peer: str, msg: bytes) -> bytes:
        """``msg`` as it must travel to ``peer`` when attached to a transfer
        posted on ``self.backend`` directly: sealed when the agent has an
        ``auth_key`` (the peer's agent drops unsealed notifications then),
        as it is.  ``notify`` and ``read_blocks``/``write_blocks`` do this themselves."""
        return msg if self._notif_seal is None else self._seal(peer, msg)

    def _seal(self, peer: str, msg: bytes) -> bytes:
        info = self._peers.get(peer)
        theirs = info.extra.get(_NOTIF_KEY) if info is not None else None
        try:
            incarnation = bytes.fromhex(theirs) if isinstance(theirs, str) else b""
        except ValueError:
            incarnation = b""
        return self._notif_seal.seal(peer, incarnation, msg)

    def _received(self) -> dict[str, list[bytes]]:
        """The backend's new notifications; with a notification seal, only the
        authentic ones (forged, altered or replayed ones are dropped)."""
        got = self.backend.get_notifs()
        if self._notif_seal is None:
            return got
        out = {}
        for sender, msgs in got.items():
            opened = [m for m in (self._notif_seal.open(sender, bytes(x)) for x in msgs) if m is not None]
            if len(opened) != len(msgs):
                log.debug("dropped %d unauthenticated notification(s) claiming to be from %r",
                          len(msgs) - len(opened), sender[:64])
            if opened:
                out[sender] = opened
        return out

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Everything received since the last call, by sender."""
        with self._notif_lock:
            out = self._pending.take()
            for sender, msgs in self._received().items():
                out.setdefault(sender, []).extend(msgs)
        return out

    def wait_notif(self, peer: str | None = None, timeout: float = 10.0,
                   match: bytes | None = None) -> tuple[str, bytes]:
        """The next notification (from ``peer``, equal to ``match``, if given);
        others stay queued for ``get_notifs`` (up to a backend inbox's bound:
        beyond it, the newest are dropped and logged)."""

        def take():
            with self._notif_lock:
                got, dropped = self._pending.take_first(peer, match), 0
                for sender, msgs in self._received().items():
                    for m in msgs:
                        if got is None and peer in (None, sender) and (match is None or m == match):
                            got = sender, m
                        elif not self._pending.deliver(sender, m):
                            dropped += 1
                if dropped:
                    log.warning("dropped %d notification(s): the unread ones fill the queue (%d messages / "
                                "%d bytes); call get_notifs", dropped, self._pending.max_msgs, self._pending.max_bytes)
                return got

        return poll_until(take, timeout, f"notification from {peer or 'any peer'}")

    # -- lifecycle ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"agent {self.name!r} is closed")

    def close(self) -> None:
        """Stop the side channel and close the backend: transfers still in
        flight end ``ERR``, and every handle is released.  Idempotent, also
        from several threads at once (each returns once it is closed)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            # an attempt on a lost peer (a thread of ours) may be loading it into the backend: let that
            # end first (a load that starts later finds the agent closed)
            for peer in list(self._recovering):
                lock = self._peer_lock(peer)
                if lock.acquire(timeout=self.config.transfer_timeout + 5):
                    lock.release()
            if self._discovery is not None:
                self._discovery.close()
            if self._server is not None:
                self._server.close()
            self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, backend={self.backend_name!r}, peers={len(self._peers)})"


if _fastpath is None:
    Agent.transfer_blocks = Agent._transfer_blocks
else:
    _fastpath.setup(Transfer, ClosedError, InvalidHandle, _PROC, _DONE_STATE, np.empty, np.dtype(np.int64))
