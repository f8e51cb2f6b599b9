"""The backend protocol (SPI): what a plugin implements.

A backend moves bytes between registered memory of its own agent and of
remote agents.  It is modelled on NIXL's agent API so that a NIXL-backed
plugin is a thin adapter, but owned by kvt and typed.

Lifecycle of a transfer::

    h = b.register(Descs.from_buffers([kv]))            # make memory reachable
    peer = b.add_remote(remote_metadata_bytes)          # load a peer
    lp = b.prep(None, local_descs)                      # once per layout
    rp = b.prep(peer, remote_descs)
    x = b.transfer(Op.READ, lp, [0, 5], rp, [3, 4], notif=b"req-7")
    while b.check_state(x).pending: ...                 # PROC -> DONE | ERR
    b.release(x)

A request done before ``transfer`` returns may come back as ``SETTLED``
instead of a handle (UCX and NIXL posts say the same): nothing to poll or
free, and ``kvt.Agent`` then never calls the backend about it again.

Contract every backend keeps (the conformance suite checks each):

* ``transfer`` never blocks on the network; ``check_state`` never blocks long.
* ``SETTLED`` means every byte is in place; ``check_state(SETTLED)`` is
  ``DONE`` and ``release(SETTLED)`` does nothing, however often.
* A ``notif`` attached to a transfer is delivered only after all its bytes
  have landed at the target.
* Descriptors outside registered memory, an unknown peer, a released handle:
  a typed error *before* any byte moves.
* A dead or unreachable peer turns in-flight transfers into ``ERR`` within
  the configured ``timeout`` option.  Nothing hangs; nothing leaks.
* With ``capabilities.stops_on_err``: once a transfer is ``ERR`` (or
  released), none of its bytes land any more, whatever the peer does next.
* Only :mod:`kvt.errors` escapes.
* Operations outside ``capabilities`` raise ``UnsupportedOperation``.
* ``close`` is idempotent; every other verb raises ``ClosedError`` after it.
"""

from __future__ import annotations

import abc
import difflib
import math
import threading
from typing import Any, ClassVar, Mapping

import numpy as np

from .config import check_timeout
from .errors import (ClosedError, ConfigError, InvalidArgument, InvalidHandle, KvtTimeoutError, UnknownPeer,
                     UnsupportedOperation)
from .types import (SETTLED, Availability, Capabilities, Descs, MemKind, Op, PrepHandle,
                    RegHandle, XferHandle, XferState, as_index, is_settled)

__all__ = ["Backend", "SETTLED", "CORE_OPTIONS", "RegionTable", "HandleTable", "take_handle", "PeerTable", "Inbox",
           "unknown_peer", "seconds"]


#: the options kvt itself sets for every backend (``auth_key`` only for ``uses_auth_key`` ones)
CORE_OPTIONS = frozenset({"timeout", "auth_key"})


class Backend(abc.ABC):
    """Base class of every kvt backend.

    Subclasses set ``capabilities`` and implement the abstract verbs.
    ``options`` are the backend's own settings from kvt's configuration; the
    common ones are ``timeout`` (seconds before an unresponsive peer turns a
    transfer to ``ERR``, default 30).
    """

    #: what this backend can do; declared as data, never implied by its name
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: True for a backend with its own kvt sockets: the Agent then passes the configured
    #: ``auth_key`` as option ``auth_key`` (a ``kvt.auth.Secret``) so it can authenticate them
    uses_auth_key: ClassVar[bool] = False
    #: the option keys this backend reads besides ``timeout`` (and ``auth_key``, see above).
    #: kvt refuses any other key set for this backend (``-o``, ``[backends.NAME]``,
    #: ``options=``) with ``ConfigError``, so a typo is not silently a default; keys of the
    #: shared ``[options]`` table it does not know are dropped with a log line.  ``None``:
    #: undeclared, every key reaches the constructor.
    option_names: ClassVar[frozenset[str] | None] = None
    #: for operators (``kvt backends``): which post path ``transfer`` takes in this process,
    #: ``"native (why)"`` or ``"python (why)"``, for a backend with a compiled one and its
    #: pure-Python twin; ``None``: it has one path only
    post_path: ClassVar[str | None] = None

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        if not agent_name:
            raise InvalidArgument("agent_name must be a non-empty string")
        self.agent_name = agent_name
        self.options = dict(options or {})
        self.check_options(self.options)
        self.timeout = float(check_timeout(self.options.get("timeout", 30.0), f"{type(self).__name__} option timeout"))
        self._closed = False
        self._ids = iter(range(1, 1 << 62))  # next() on it is one C call: atomic under the GIL

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` for a key of ``options`` this backend does not
        read (``option_names``, plus ``CORE_OPTIONS``); the constructor calls it."""
        if cls.option_names is None:
            return
        for key in options:
            if key not in cls.option_names and key not in CORE_OPTIONS:
                names = sorted(cls.option_names | {"timeout"})
                close = difflib.get_close_matches(str(key), names, n=1)
                raise ConfigError(
                    f"{cls.__name__} has no option {key!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                    f"its options: {', '.join(names)}. Options shared by several backends belong in the config "
                    "file's [options] table, which ignores keys a backend does not read")

    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run on this machine (cheap; no network)."""
        return Availability(True)

    # -- memory ---------------------------------------------------------------

    @abc.abstractmethod
    def register(self, mem: Descs) -> RegHandle:
        """Make the memory in ``mem`` reachable by local and remote transfers.

        Regions may overlap and may be empty.  Raises ``UnsupportedOperation``
        for a memory kind not in ``capabilities.mem_kinds``.  Remote agents
        see a registration after re-fetching this agent's metadata.
        """

    @abc.abstractmethod
    def deregister(self, handle: RegHandle) -> None:
        """Undo ``register``.  An unknown or already deregistered handle
        raises ``InvalidHandle`` and changes nothing.  Memory that no other
        registration holds is gone for this backend's own transfers: those
        still moving its bytes have landed or end ``ERR`` before this returns,
        and a transfer posted later with a prep of it is refused
        (``InvalidDescriptor`` at post, or ``ERR``); memory registered twice
        stays usable (``RegionTable.lost``).  A backend whose own code serves
        peers' requests (``owner_check="server"``) also returns only once none
        of them touches that memory any more, same-host peers' direct copies
        included (``kvt.epoch``).  The caller may free the memory next."""

    def get_xfer_descs(self, mem: Any, kind: MemKind | str | None = None) -> Descs:
        """Build a descriptor list from ``Descs``, an ``(n, 3)`` array of
        ``(address, length, device)``, ``(addr, len, dev)`` tuples, or torch
        tensors / numpy arrays.  Vectorised; no per-row Python work.
        Backends may override to attach a native list."""
        self._check_open()
        descs = Descs.coerce(mem, kind)
        self._check_kind(descs.kind)
        return descs

    # -- peers ----------------------------------------------------------------

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_remote`` to reach us.
        Includes the memory registered so far."""

    @abc.abstractmethod
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata (re-loading refreshes it); returns the peer's
        agent name.  Malformed bytes raise ``WireError``.

        Re-loading a loaded peer:

        * the same metadata, the peer not failed: changes nothing; its
          connection and transfers in flight are left alone
          (``kvt.Agent.reconnect`` re-adds unchanged metadata after one
          transfer failed);
        * the same metadata of a peer the backend gave up on (it stopped
          answering or its connection broke): reconnects it;
        * metadata of a new incarnation (same name, a restarted process):
          replaces the peer; what was in flight to the old one ends ``ERR``
          (``PeerDisconnected``) at once.
        """

    @abc.abstractmethod
    def remove_remote(self, peer: str) -> None:
        """Forget a peer; its in-flight transfers end in ``ERR``.  An unknown
        peer raises ``UnknownPeer``."""

    # -- transfers ------------------------------------------------------------

    @abc.abstractmethod
    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        """Prepare a descriptor list once; transfers then address it by index.

        ``peer=None`` means our own memory (the local side of a transfer, or
        both sides of a local transfer).  The list must lie inside memory
        registered by that agent (as far as its metadata tells), else
        ``InvalidDescriptor``; an unknown peer raises ``UnknownPeer``."""

    @abc.abstractmethod
    def transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any,
                 remote_prep: PrepHandle, remote_idx: Any,
                 notif: bytes | None = None) -> XferHandle:
        """Post a one-sided ``op`` pairing local rows ``local_idx`` with remote
        rows ``remote_idx`` (equal counts and pairwise equal lengths; ``None``
        means every row).  Returns at once with a handle, or ``SETTLED`` if
        every byte is in place already (a small same-host copy done on the
        caller's thread); never blocks on the network.  ``notif`` reaches the
        remote agent after all bytes landed.
        Errors in the arguments raise before any byte moves.  Initiators poll
        ``check_state`` until the transfer settles: a backend may make
        progress, and send the notification, only when polled (NIXL does)."""

    @abc.abstractmethod
    def check_state(self, handle: XferHandle) -> XferState:
        """``PROC``, ``DONE`` or ``ERR`` (with its ``TransferError`` cause).
        Never blocks long.  A released handle raises ``InvalidHandle``."""

    def wait(self, handle: XferHandle, timeout: float) -> XferState:
        """Block until the transfer settles or ``timeout`` seconds pass;
        returns its state (``PROC`` on timeout).  This default polls
        ``check_state`` (spinning briefly, then sleeping); backends whose
        completion is an event override it to block without using a core."""
        from .agent import poll_until  # the agent module imports this one

        def settled():
            s = self.check_state(handle)
            return None if s.pending else s
        try:
            return poll_until(settled, timeout, "transfer")
        except KvtTimeoutError:
            return XferState.PROC

    @abc.abstractmethod
    def release(self, handle: XferHandle | PrepHandle) -> None:
        """Free a transfer or prep handle.  Releasing a transfer still in
        flight cancels it where the backend can, else waits for it (bounded by
        ``timeout``).  Releasing twice raises ``InvalidHandle``."""

    # -- notifications --------------------------------------------------------

    @abc.abstractmethod
    def notify(self, peer: str, msg: bytes) -> None:
        """Send a small message (``<= capabilities.max_notif_bytes``) to a peer.
        Messages to one peer arrive in the order sent."""

    @abc.abstractmethod
    def get_notifs(self) -> dict[str, list[bytes]]:
        """Messages received since the last call, by sender agent name, in
        arrival order.  Never blocks.  None is longer than
        ``capabilities.max_notif_bytes``: a longer one (no kvt peer sends
        it) is dropped on arrival.  Engines call it every step, thousands
        of times a second: with nothing waiting it should not let go of the
        GIL (a release each step starves the process's other threads:
        ``benchmarks/bench_step_poll.py``)."""

    # -- lifecycle ------------------------------------------------------------

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (threads, sockets, registrations).  Idempotent.
        As ``deregister`` for every registration: with ``owner_check="server"``
        it returns only once no peer's request touches our memory."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers for implementations -------------------------------------------

    def _next_id(self) -> int:
        return next(self._ids)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"backend {type(self).__name__} of agent {self.agent_name!r} is closed")

    def _check_kind(self, kind: MemKind) -> None:
        if kind not in self.capabilities.mem_kinds:
            raise UnsupportedOperation(
                f"{type(self).__name__} does not support {kind.value} memory; it declares "
                f"{sorted(k.value for k in self.capabilities.mem_kinds)}")

    def _prep_descs(self, descs: Any) -> Descs:
        """The checks every ``prep`` starts with: the backend is open and
        ``descs`` is a ``Descs`` of a memory kind it declares."""
        self._check_open()
        descs = Descs.coerce(descs)
        self._check_kind(descs.kind)
        return descs

    @staticmethod
    def _within(descs: Descs, regions: Descs | None, peer: str | None) -> np.ndarray:
        """``descs.check_within(regions)`` worded for whose memory it is: this
        agent's (``peer`` None) or a peer's, as its metadata told (``regions``
        None: it told of none of that kind).  Returns each row's region index."""
        return descs.check_within(regions if regions is not None else Descs.empty(descs.kind),
                                  "local descriptors" if peer is None else f"descriptors of peer {peer!r}")

    def _check_op(self, op: Any, notif: bytes | None) -> Op:
        if type(op) is not Op:  # Op(op) costs a microsecond; most callers pass an Op already
            try:
                op = Op(op)
            except ValueError:
                raise InvalidArgument(f"op must be Op.READ or Op.WRITE, got {op!r}") from None
        if op not in self.capabilities.ops:
            raise UnsupportedOperation(f"{type(self).__name__} does not declare {op.value}")
        if notif is not None:
            self._check_notif(notif)
        return op

    def _check_notif(self, msg: Any) -> None:
        if not self.capabilities.notifications:
            raise UnsupportedOperation(f"{type(self).__name__} does not declare notifications")
        if not isinstance(msg, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"notification must be bytes, got {type(msg).__name__}")
        if len(msg) > self.capabilities.max_notif_bytes:
            raise InvalidArgument(f"notification of {len(msg)} bytes exceeds the declared maximum "
                                  f"{self.capabilities.max_notif_bytes}")

    @classmethod
    def _pair(cls, local: Descs, local_idx: Any, remote: Descs, remote_idx: Any) -> tuple[np.ndarray, np.ndarray]:
        """Select and check the paired rows of a transfer: equal counts and
        pairwise equal lengths.  Returns the two ``(k, 3)`` row arrays."""
        return cls._pair_indexed(local, local_idx, remote, remote_idx)[2:]

    @staticmethod
    def _pair_indexed(local: Descs, local_idx: Any, remote: Descs, remote_idx: Any):
        """``_pair``, also returning the normalised indices: ``(li, ri, lrows, rrows)``."""
        uniform = local.uniform_length
        li = as_index(local_idx, len(local), "local_idx")
        ri = as_index(remote_idx, len(remote), "remote_idx")
        if li.size != ri.size:
            raise InvalidArgument(f"local_idx selects {li.size} descriptors but remote_idx {ri.size}; "
                                  "they are paired one to one")
        lrows, rrows = local.array[li], remote.array[ri]
        if uniform is not None and uniform == remote.uniform_length:
            return li, ri, lrows, rrows  # every row of both lists has one length: pairs match
        mismatch = np.flatnonzero(lrows[:, 1] != rrows[:, 1])
        if mismatch.size:
            i = int(mismatch[0])
            raise InvalidArgument(f"{mismatch.size} descriptor pairs differ in length; first is pair {i}: "
                                  f"local {int(lrows[i, 1])} bytes vs remote {int(rrows[i, 1])} bytes")
        return li, ri, lrows, rrows


class RegionTable:
    """Registered memory by handle, for backends to build on.

    ``of(kind)`` is the union of every registration of that kind, as one
    ``Descs``; the table behind it is replaced wholesale on each change, so a
    server thread may read it without a lock and always sees a consistent
    state.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regs: dict[int, Descs] = {}
        self._by_kind: dict[MemKind, Descs] = {}

    def add(self, handle: int, descs: Descs) -> None:
        with self._lock:
            self._regs[handle] = descs
            self._rebuild()

    def remove(self, handle: int) -> Descs:
        """Forget a registration; ``InvalidHandle`` if there is none."""
        with self._lock:
            try:
                descs = self._regs.pop(handle, None)
            except TypeError:  # an unhashable handle is just not one of ours
                descs = None
            if descs is None:
                raise InvalidHandle(f"no registration with handle {handle!r} (already deregistered?)")
            self._rebuild()
            return descs

    def _rebuild(self) -> None:
        by_kind: dict[MemKind, list[np.ndarray]] = {}
        for d in self._regs.values():
            by_kind.setdefault(d.kind, []).append(d.array)
        self._by_kind = {k: Descs(np.concatenate(v), k) for k, v in by_kind.items()}

    def of(self, kind: MemKind) -> Descs:
        """Every registered region of ``kind`` (empty if none)."""
        d = self._by_kind.get(kind)
        return d if d is not None else Descs.empty(kind)

    def by_kind(self) -> dict[MemKind, Descs]:
        return dict(self._by_kind)

    def lost(self, removed: Descs, rows: Any) -> bool:
        """Whether ``rows`` (``(k, 3)``, of ``removed``'s kind) touch memory
        that ``removed``, a registration just taken out, held and no
        registration holds now: what a backend's ``deregister`` must stop its
        own transfers and preps of (memory registered twice stays usable)."""
        return removed.overlaps(rows) and bool((Descs(rows, removed.kind).locate(self.of(removed.kind)) < 0).any())

    def clear(self) -> None:
        with self._lock:
            self._regs.clear()
            self._by_kind = {}


class HandleTable(dict):
    """Handle -> object.  Looking up a handle that is not there (released,
    never issued, or not a handle at all) raises ``InvalidHandle`` naming
    ``what`` it should have been.  With ``settled`` (a backend's record of a
    finished transfer), ``SETTLED`` is never stored yet always there: looked
    up or taken, any number of times, it gives ``settled``."""

    def __init__(self, what: str, settled: Any = None):
        super().__init__()
        self.what, self.settled = what, settled

    def __getitem__(self, handle):
        try:
            return super().__getitem__(handle)
        except (KeyError, TypeError):
            if self.settled is not None and is_settled(handle):
                return self.settled
            raise InvalidHandle(f"no {self.what} with handle {handle!r} (released?)") from None

    def take(self, handle):
        """Remove and return the object, or ``None`` if there is none."""
        try:
            obj = self.pop(handle, None)
        except TypeError:  # unhashable: certainly not one of ours
            return None
        if obj is None and self.settled is not None and is_settled(handle):
            return self.settled
        return obj


def take_handle(preps: HandleTable, xfers: HandleTable, handle):
    """``release``'s lookup: a prep handle is removed and ``None`` returned; a
    transfer handle is removed and its object returned; anything else raises
    ``InvalidHandle``."""
    if preps.take(handle) is not None:
        return None
    obj = xfers.take(handle)
    if obj is None:
        raise InvalidHandle(f"no transfer or prep with handle {handle!r} (released twice?)")
    return obj


class PeerTable(dict):
    """Peer name -> what a backend keeps of it.  Looking up (``[]``, ``named``)
    or removing a name nobody loaded, or one already removed, raises
    ``UnknownPeer`` listing the names that are loaded.  ``[]`` is the plain
    dict lookup (the hot path: names the backend checked before); a name
    straight from a caller goes through ``named`` or ``remove``, which also
    refuse an unhashable one with ``UnknownPeer`` (dict raises TypeError)."""

    def __missing__(self, name):
        raise unknown_peer(name, self)

    def named(self, name):
        """The peer's entry; ``UnknownPeer`` if there is none."""
        try:
            return self[name]
        except TypeError:
            raise unknown_peer(name, self) from None

    def remove(self, name):
        """Remove and return the peer's entry; ``UnknownPeer`` if there is none."""
        self.named(name)
        try:
            return self.pop(name)
        except KeyError:  # removed by another thread meanwhile
            raise unknown_peer(name, self) from None


class Inbox:
    """Notifications received, by sender, in arrival order (thread-safe).

    Bounded: at most ``max_msgs`` messages and ``max_bytes`` bytes wait
    unread; ``deliver`` refuses (returns False) beyond that, so peers that
    flood us cost a bounded amount of memory until the engine reads.
    """

    def __init__(self, max_msgs: int = 1 << 16, max_bytes: int = 64 << 20) -> None:
        self._lock = threading.Lock()
        self._msgs: dict[str, list[bytes]] = {}
        self._count = self._bytes = 0
        self.max_msgs, self.max_bytes = max_msgs, max_bytes

    def deliver(self, sender: str, msg: bytes) -> bool:
        with self._lock:
            if self._count >= self.max_msgs or self._bytes + len(msg) > self.max_bytes:
                return False
            self._msgs.setdefault(sender, []).append(msg)
            self._count += 1
            self._bytes += len(msg)
        return True

    def take(self) -> dict[str, list[bytes]]:
        """Everything received since the last call."""
        with self._lock:
            out, self._msgs = self._msgs, {}
            self._count = self._bytes = 0
        return out

    def take_first(self, sender: str | None = None, match: bytes | None = None) -> tuple[str, bytes] | None:
        """The oldest message (from ``sender``, equal to ``match``, if given), removed; ``None`` if none."""
        with self._lock:
            for s, msgs in self._msgs.items():
                if sender not in (None, s):
                    continue
                for i, m in enumerate(msgs):
                    if match is None or m == match:
                        del msgs[i]
                        self._count -= 1
                        self._bytes -= len(m)
                        return s, m
        return None


def seconds(timeout: Any, what: str = "timeout") -> float:
    """``timeout`` as seconds: a finite real number (a negative one counts as
    0: look once).  NaN would never expire and infinity never end a wait, so
    both are refused (``InvalidArgument``), as is anything but a number.  For
    backends' ``wait`` and every other bounded wait."""
    if isinstance(timeout, (int, float, np.integer, np.floating)) and not isinstance(timeout, bool):
        try:
            t = float(timeout)
        except OverflowError:  # an int past any float (10**400): no wait is that long, nor that negative
            raise InvalidArgument(f"{what} must be a finite number of seconds, got an int of "
                                  f"{int(timeout).bit_length()} bits") from None
        if math.isfinite(t):
            return min(max(t, 0.0), threading.TIMEOUT_MAX)  # (longer overflows a thread wait)
    raise InvalidArgument(f"{what} must be a finite number of seconds, got {timeout!r}")


def unknown_peer(name: str, known) -> UnknownPeer:
    """The error for a peer nobody loaded, listing the ones that are."""
    return UnknownPeer(f"unknown peer {name!r}; load its metadata with add_remote first "
                       f"(known: {sorted(known) or 'none'})")
