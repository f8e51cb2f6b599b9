"""``ucx``: kvt's one-sided verbs on UCX RMA (``ucp_get_nbx``/``ucp_put_nbx``
with remote keys), through the compiled binding :mod:`kvt_ucx._ucp`.

A transfer is one call into C with numpy arrays of (local address, remote
address, length, remote-key index): no per-block Python.  The target runs no
code for the data; only memory it registered has remote keys, and its
metadata carries them.  A notification is an active message sent after a flush
of the endpoint, so it arrives after the data.  A C progress thread sleeps on
the worker's event fd; polling ``check_state`` also progresses the worker.

Dead peers: UCX's peer error handling disables its fast same-host transport
(cross-memory attach: 10 GB/s -> 0.7 GB/s over TCP here), so endpoints to
same-host peers run without it (unless the settings leave out every
same-host transport).  A dead same-host peer is still reported:
the C progress thread watches a pidfd of each same-host peer and fails its
endpoint when the process exits (no cost per transfer).
Endpoints to other hosts use peer error handling.  Every transfer also has a
deadline (``timeout``); a peer that misses it is disconnected (the endpoint
force-closed, which cancels what is in flight), so a transfer in ERR writes
nothing later.  See docs/backends/ucx.md.

Options: ``timeout`` (s, default 30), ``error_handling`` (``auto`` | ``peer``
| ``none``), ``ucx_env`` (UCX_* settings, as for the nixl backend, e.g.
``{UCX_TLS = "cma,tcp,self"}``), ``ucx`` (the same without the ``UCX_``
prefix), ``notif_queue`` (notifications held at most, default 4096).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np
from kvt.backend import Backend, HandleTable, Inbox, PeerTable, RegionTable, take_handle
from kvt.epoch import Epoch, EpochWatch, table, vouched_watch
from kvt.errors import (ConfigError, InvalidArgument, InvalidDescriptor, PeerDisconnected, RemoteRejected,
                        TransferError, TransferTimeout, WireError)
from kvt.procs import host_id, is_process, start_time
from kvt.ucxkeys import LOOPBACK, cross_host_refused, loopback_default
from kvt.types import (Availability, Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle, XferHandle,
                       XferState)
from kvt.wire import Message, decode, encode

from . import native, vet

__all__ = ["UcxBackend", "UcxMetadata"]

_MODES = ("auto", "peer", "none")
_MAX_NOTIF = 1 << 20
_MAX_ADDRESS = 1 << 16  # a UCX worker address is a few hundred bytes
_MAX_RKEY = 1 << 12
_MAX_NAME = 256  # characters of a peer's name (as the host and nixl backends)
# same-host requests of at least this many bytes are copied on two lanes (two CPUs) at once
_SPLIT_BYTES = 2 << 20


class UcxMetadata(Message, tag="ucx_rma_md"):
    """``local_metadata()``: who we are, how to reach us, and our registered
    DRAM rows with one packed remote key per row (same order)."""

    name: str
    address: bytes          # UCX worker address
    host: str               # host_id(): equal means same host and same /proc view
    pid: int
    start: int              # start_time(pid): a reused pid is not taken for the peer
    rows: bytes             # (n, 3) uint64: address, length, device
    rkeys: list[bytes]
    epoch_fd: int = -1      # its registration epoch (kvt.epoch), for same-host peers
    epoch: int = 0


def _process(md: UcxMetadata) -> tuple:
    """What stays while a peer's process lives (its metadata's rows and keys may change)."""
    return md.address, md.host, md.pid, md.start


@dataclass
class _Peer:
    md: UcxMetadata
    regions: Descs
    ep: Any                 # _ucp.Endpoint
    keys: list              # _ucp.RemoteKey per row of ``regions``
    same_host: bool
    epoch: EpochWatch | None = None  # same host: cma ignores remote keys, so we watch its deregistrations
    pidfd: int = -1                  # same host: readable once it exited (our own dup of the C watch's)
    failed: TransferError | None = None  # it stopped answering: disconnected until its metadata is re-added
    dropped: bool = False            # its keys and endpoint are closed (once: see _drop)
    retired: bool = False            # replaced by its own refreshed metadata: dropped once idle (_reap)


@dataclass(frozen=True)
class _Prep:
    peer: str | None
    descs: Descs
    local: np.ndarray       # (n, 2) uint64: address, length (this list as the local side)
    remote: np.ndarray      # (n, 3) uint64: address, length, key index (as the remote side)
    owner: Any = None       # the _Peer whose regions (and keys) the rows were checked against
    retired: bool = False   # our own memory, deregistered since: transfers with it are refused


class _Xfer:
    """A posted transfer: its op, peer, the binding's Xfer, deadline, state."""

    __slots__ = ("op", "peer", "native", "deadline", "state", "ours")

    def __init__(self, op: Op, peer: _Peer, native: Any, deadline: float, ours: tuple = ()):
        self.op, self.peer, self.native, self.deadline, self.state = op, peer, native, deadline, _PROC
        self.ours = ours  # the preps of our own memory it moves (deregister waits for it)


def _caps() -> Capabilities:
    return Capabilities(mem_kinds=frozenset({MemKind.DRAM}), ops=frozenset(Op), notifications=True, local=True,
                        remote=True, cross_host=True, max_notif_bytes=_MAX_NOTIF,
                        cross_host_options={"ucx": {"TLS": "tcp"}}, owner_check="transport",
                        stops_on_err=True)  # a peer that misses a deadline is force-disconnected (_fail)


def _shm_possible(config: Mapping[str, str]) -> bool:
    """Whether UCX may move bytes between processes of this host through
    memory (cross-memory attach or shared segments; its default transports
    include both) under these settings.  Those transports lack, or are turned
    off by, peer error handling: then same-host endpoints run without it."""
    tls = config.get("TLS", os.environ.get("UCX_TLS", "all")).strip()
    names = {t.strip() for t in tls.lstrip("^").split(",")}
    if tls.startswith("^"):  # an exclusion list
        return not (names & {"sm", "shm"} or names >= {"cma", "posix", "sysv", "xpmem", "knem"})
    return bool(names & {"all", "sm", "shm", "cma", "posix", "sysv", "xpmem", "knem"})


def _ucx_config(options: Mapping[str, Any]) -> dict[str, str]:
    """UCX settings without the ``UCX_`` prefix, from ``ucx_env`` (UCX_*
    names, the nixl backend's option) and ``ucx`` (bare names)."""
    env, bare = options.get("ucx_env", {}), options.get("ucx", {})
    if not isinstance(env, Mapping) or not isinstance(bare, Mapping):
        raise ConfigError("ucx backend options 'ucx_env' and 'ucx' must be tables of UCX settings")
    bad = [k for k in env if not str(k).startswith("UCX_")]
    if bad:
        raise ConfigError(f"ucx backend option 'ucx_env' takes UCX_* variables only, got {bad}")
    out = {str(k)[4:]: str(v) for k, v in env.items()}
    out.update({str(k): str(v) for k, v in bare.items()})
    return out


def _index(idx: Any) -> Any:
    """What the binding takes: None (every row) or a contiguous int64/int32 array."""
    if idx is None or (isinstance(idx, np.ndarray) and idx.dtype in _INDEX_TYPES and idx.flags.c_contiguous):
        return idx
    arr = np.asarray(idx)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"indices must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    return np.ascontiguousarray(arr, np.int64)


_INDEX_TYPES = (np.dtype(np.int64), np.dtype(np.int32))
_READ, _WRITE = Op.READ, Op.WRITE
_PROC, _DONE = XferState.PROC, XferState.DONE
_PROC_STATUS = _PROC.status


class UcxBackend(Backend):
    """kvt over UCX RMA.  One UCP context, worker and C progress thread per instance."""

    capabilities = _caps()

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, f"needs Linux; this is {sys.platform}")
        reason = native.load_error()
        return Availability(not reason, reason)

    option_names = frozenset({"error_handling", "notif_queue", "split_bytes", "ucx_env", "ucx"})  # docs/backends/ucx.md

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        super().__init__(agent_name, options)
        o = self.options
        self._mode = o.get("error_handling", "auto")
        if self._mode not in _MODES:
            raise ConfigError(f"ucx backend option 'error_handling' must be one of {_MODES}, got {self._mode!r}")
        queue = o.get("notif_queue", 4096)
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ConfigError(f"ucx backend option 'notif_queue' must be a positive integer, got {queue!r}")
        split = o.get("split_bytes", _SPLIT_BYTES if (os.cpu_count() or 1) > 1 else 0)
        if isinstance(split, bool) or not isinstance(split, int) or split < 0:
            raise ConfigError(f"ucx backend option 'split_bytes' must be an integer >= 0 (0: never split), "
                              f"got {split!r}")
        config = _ucx_config(o)
        # UCX's tcp transport serves RMA in software at whatever address a peer names (no remote-key
        # check): it listens on loopback only unless the operator names interfaces (docs/security.md)
        if loopback_default(config, "NET_DEVICES"):
            config["NET_DEVICES"] = LOOPBACK
        self._ucp, self._config, self._shm = native.load(), config, _shm_possible(config)
        try:
            self._worker = self._ucp.Worker(agent_name.encode(), config, _MAX_NOTIF, queue, 64 * _MAX_NOTIF, split)
            self._address = self._worker.address()
        except self._ucp.Error as e:
            raise ConfigError(f"UCX refused to start with settings {config} (options 'ucx_env'/'ucx') and the "
                              f"UCX_* environment: {e.args[0]}") from None
        pid = os.getpid()
        self._host, self._pid, self._start = host_id(), pid, start_time(pid)
        self._lock = threading.RLock()
        self._regions = RegionTable()
        self._mapped: dict[int, list[tuple[Any, bytes]]] = {}  # handle -> (MemHandle, packed rkey) per row
        self._preps = HandleTable("prepped descriptor list")
        self._xfers = HandleTable("transfer")
        self._peers = PeerTable()  # name -> _Peer
        self._self: _Peer | None = None  # ourselves as a peer, for local transfers
        self._retired: list[_Peer] = []  # replaced by the same process's new metadata, transfers still in flight
        self._inbox = Inbox()
        self._epoch = Epoch()  # bumped by deregister, watched by same-host peers
        self._publish()

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Any) -> RegHandle:
        self._check_open()
        descs = Descs.coerce(mem)
        self._check_kind(descs.kind)
        mapped = []
        try:
            for addr, n in descs.array[:, :2].tolist():
                mapped.append(self._worker.mem_map(addr, n) if n else (None, b""))
        except (self._ucp.Error, ValueError, OverflowError) as e:
            for m, _ in mapped:
                if m is not None:
                    m.unmap()
            raise InvalidArgument(f"UCX cannot register this memory: {e.args[0] if e.args else e}") from None
        h = self._next_id()
        with self._lock:
            self._mapped[h] = mapped
            self._regions.add(h, descs)
            self._self = None
            self._publish()
        return RegHandle(h)

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        with self._lock:
            descs = self._regions.remove(handle)
            retired = set()
            for h, p in list(self._preps.items()):  # lists of it: refused from now on
                if p.peer is None and p.descs.kind is descs.kind and self._regions.lost(descs, p.descs.array):
                    self._preps[h] = replace(p, retired=True)
                    retired.add(id(p))
            # our own transfers still moving its bytes land (or fail) first, as on release: UCX cannot
            # call back bytes it has posted, and the caller frees the memory next
            for x in list(self._xfers.values()):
                if any(id(p) in retired for p in x.ours):
                    end = x.deadline + 1.0
                    while self._state(x).status is _PROC_STATUS and time.monotonic() < end:
                        time.sleep(0.0002)
            for m, _ in self._mapped.pop(handle, []):
                if m is not None:
                    m.unmap()
            self._self = None
            # same-host peers copy with cma, which ignores keys: their next posts see this and refuse
            # (one already under way is not waited for: owner_check "transport", see docs/backends/ucx.md)
            self._epoch.bump()
            self._publish()

    # -- peers ----------------------------------------------------------------

    def _rows(self) -> bytes:
        """Our registered rows as our metadata carries them (call holding the lock)."""
        return np.ascontiguousarray(self._regions.of(MemKind.DRAM).array, np.uint64).tobytes()

    def _publish(self) -> None:
        """Vouch on our epoch page for the rows and the worker address our
        metadata carries from now on (call holding the lock, or in __init__):
        a same-host peer refuses metadata that claims other rows of us, or
        pairs our pid with another process's address (kvt.epoch)."""
        self._epoch.publish(table(self._rows(), self._address))

    def _metadata(self) -> UcxMetadata:
        with self._lock:  # rows and keys in the same order: the RegionTable's (registration order)
            rows = self._rows()
            rkeys = [k for mapped in self._mapped.values() for _, k in mapped]
            epoch = self._epoch.value
        return UcxMetadata(name=self.agent_name, address=self._address, host=self._host, pid=self._pid,
                           start=self._start, rows=rows, rkeys=rkeys, epoch_fd=self._epoch.fd, epoch=epoch)

    def local_metadata(self) -> bytes:
        self._check_open()
        vet.start(self._config)  # peers are coming: have the sandbox up before their metadata
        return encode(self._metadata())

    def _connect(self, md: UcxMetadata, ours: bool = False) -> _Peer:
        if not md.address or len(md.address) > _MAX_ADDRESS or any(len(k) > _MAX_RKEY for k in md.rkeys):
            raise WireError(f"metadata of {md.name!r}: worker address or remote keys of impossible size")
        raw = md.rows
        if len(raw) % 24 or len(raw) // 24 != len(md.rkeys):
            raise WireError(f"metadata of {md.name!r}: {len(raw)} bytes of rows for {len(md.rkeys)} remote keys")
        try:
            regions = Descs(np.frombuffer(raw, np.uint64).reshape(-1, 3), MemKind.DRAM)
        except Exception as e:
            raise WireError(f"metadata of {md.name!r}: bad region rows: {e}") from None
        same_host = md.host == self._host
        if not same_host and self._config.get("NET_DEVICES") == LOOPBACK:
            raise ConfigError(cross_host_refused(md.name, 'ucx = {NET_DEVICES = "eth0"}'))
        peer_mode = self._mode == "peer" or (self._mode == "auto" and not (same_host and self._shm))
        if not ours:
            vet.vet(self._config, self._address, md.address, md.rkeys, peer_mode, md.name)
        # UCX's cma acts on whatever rows the metadata names, in whatever process its address names:
        # on this host, only metadata its owner vouches for (kvt.epoch; also an agent of ours)
        epoch = vouched_watch(md.pid, md.start, md.epoch_fd, md.epoch, table(raw, md.address), md.name) \
            if same_host and not ours else None
        ep, own, watched, keys, pidfd = None, -1, False, [], -1
        try:
            # an agent in this same process cannot die on its own: nothing to watch
            pidfd = self._pidfd(md) if epoch is not None and md.pid != self._pid else -1
            try:
                ep = self._worker.connect(md.address, peer_mode)
            except self._ucp.Error as e:
                raise PeerDisconnected(f"cannot reach peer {md.name!r}: {e.args[0]}") from None
            if pidfd >= 0:
                own = os.dup(pidfd)
                ep.watch(pidfd)  # the progress thread fails the endpoint when the process exits
                watched = True  # (the endpoint owns pidfd from here)
            try:
                for k in md.rkeys:
                    keys.append(ep.unpack(k) if k else None)
            except self._ucp.Error as e:
                raise WireError(f"metadata of {md.name!r}: a remote key UCX cannot unpack: {e.args[0]}") from None
        except BaseException as e:  # nothing made for it stays open
            for h in [*(k.destroy for k in keys if k is not None), *([ep.close] if ep is not None else [])]:
                try:
                    h()
                except Exception:  # noqa: BLE001 - the worker closed under it: freed with the worker
                    pass
            for fd in ([pidfd] if pidfd >= 0 and not watched else []) + ([own] if own >= 0 else []):
                os.close(fd)
            if epoch is not None:
                epoch.close()
            if isinstance(e, RuntimeError):  # the C module's "the UCX worker is closed": close() ran meanwhile
                self._check_open()
            raise
        return _Peer(md, regions, ep, keys, same_host, epoch, own)

    def _pidfd(self, md: UcxMetadata) -> int:
        """A pidfd of a same-host peer, after checking the pid is that peer's."""
        if md.pid <= 0 or not is_process(md.pid, md.start):
            raise PeerDisconnected(f"peer {md.name!r} (pid {md.pid} on this host) is not running")
        try:
            return os.pidfd_open(md.pid)
        except (OSError, OverflowError) as e:
            raise PeerDisconnected(f"peer {md.name!r} (pid {md.pid} on this host) is not running: {e}") from None

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        md = decode(metadata, UcxMetadata)
        if not 0 < len(md.name) <= _MAX_NAME:  # "" would be a peer no error message can name
            raise WireError(f"peer name must be 1 to {_MAX_NAME} characters, got {len(md.name)}")
        if md.name == self.agent_name:
            raise InvalidArgument(f"metadata is this agent's own ({md.name!r}); local transfers use prep(None, ...)")
        old = self._peers.get(md.name)
        if old is not None and old.md == md and old.failed is None and not old.dropped and old.ep.error() == 0:
            # unchanged metadata of a live peer (kvt.Agent.reconnect sends it): keep its endpoint, or
            # what is in flight to it would fail; a failed or disconnected one is reconnected below
            return md.name
        peer = self._connect(md)
        with self._lock:
            closed = self._closed  # close() ran while we connected, and did not see this peer
            if closed:
                old = None
            else:
                old = self._peers.pop(md.name, None)
                self._peers[md.name] = peer
            if old is not None and old.failed is None and _process(old.md) == _process(md):
                # the same process registered or deregistered memory: what is in flight to it
                # finishes on the old endpoint and keys, freed once it settled
                old.retired = True
                self._retired.append(old)
                old = None
            gone = self._take_retired(md.name) if old is not None else []
        for p in [old, *gone]:
            if p is not None and p.failed is None:  # a failed one is disconnected already
                self._drop(p, PeerDisconnected(f"peer {md.name!r} was replaced by new metadata"))
        if closed:
            self._drop(peer, PeerDisconnected("backend closed"))
            self._check_open()
        self._reap()
        return md.name

    def remove_remote(self, peer: str) -> None:
        self._check_open()
        with self._lock:
            p = self._peers.remove(peer)
            gone = self._take_retired(peer)
        for q in [p, *gone]:
            self._drop(q, PeerDisconnected(f"peer {peer!r} was removed"))

    def _take_retired(self, name: str) -> list[_Peer]:
        """Retired connections to ``name``, no longer kept (call holding the lock)."""
        gone = [p for p in self._retired if p.md.name == name]
        self._retired = [p for p in self._retired if p.md.name != name]
        return gone

    def _reap(self) -> None:
        """Free retired connections nothing is in flight on any more."""
        if not self._retired:
            return
        busy = {id(x.peer) for x in list(self._xfers.values()) if x.state.status is _PROC_STATUS}
        with self._lock:
            idle = [p for p in self._retired if id(p) not in busy]
            self._retired = [p for p in self._retired if id(p) in busy]
        for p in idle:  # a transfer posted on it after the scan above (it raced add_remote) ends with:
            self._drop(p, PeerDisconnected(f"peer {p.md.name!r} was re-added with new metadata while this "
                                           "transfer was posted on its old connection; post it again"))

    def _fail(self, p: _Peer, cause: TransferError) -> None:
        """``p`` did not finish a transfer in time: disconnect it.  Closing the
        endpoint (forced where it has UCX's peer error handling) cancels what
        is in flight to it, so no byte of a transfer lands after the transfer
        has ended in ERR: the caller may reuse that memory at once.  (A
        same-host endpoint has none while shared-memory transports are
        configured: over cma this process makes the copy itself and it ends;
        over posix/sysv segments alone a stalled one can still land.)  Later
        transfers to it fail until its metadata is re-added."""
        p.failed = PeerDisconnected(f"peer {p.md.name!r} stopped answering ({cause}); "
                                    "re-add its metadata to try again")
        self._drop(p, cause)

    def _drop(self, p: _Peer, cause: TransferError) -> None:
        """End transfers to ``p`` with ``cause``, then free its keys and endpoint
        (once: two threads past a deadline both get here)."""
        for x in list(self._xfers.values()):
            if x.peer is p:
                self._end(x, XferState.err(cause))
        with self._lock:
            if p.dropped:
                return
            p.dropped = True
        for k in p.keys:
            if k is not None:
                k.destroy()
        p.ep.close()
        if p.pidfd >= 0:
            os.close(p.pidfd)
            p.pidfd = -1
        with self._lock:  # our open of its epoch page (a post racing this reads it as not stale)
            w, p.epoch = p.epoch, None
        if w is not None:
            w.close()

    def _peer(self, name: str | None) -> _Peer:
        if name is None:
            with self._lock:
                if self._self is None:
                    self._self = self._connect(self._metadata(), ours=True)
                return self._self
        return self._peers.named(name)

    # -- transfers ------------------------------------------------------------

    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        descs = self._prep_descs(descs)
        owner = None if peer is None else self._peer(peer)
        h = self._next_id()
        self._preps[h] = self._checked(peer, descs, owner)
        return PrepHandle(h)

    def _checked(self, peer: str | None, descs: Descs, owner: "_Peer | None") -> _Prep:
        """``descs`` checked against our registrations or ``owner``'s, with each row's key index."""
        region = self._within(descs, self._regions.of(descs.kind) if owner is None else owner.regions, peer)
        table = np.empty((len(descs), 3), np.uint64)
        table[:, :2] = descs.array[:, :2]
        table[:, 2] = region
        return _Prep(peer, descs, np.ascontiguousarray(table[:, :2]), table, owner)

    def _recheck(self, handle: PrepHandle, rp: _Prep, peer: "_Peer") -> _Prep:
        """A remote prep made before its peer was re-added (a restart registers
        other memory, and key indices name the new keys): checked again against
        what the peer registers now (``InvalidDescriptor`` if outside), once."""
        new = self._checked(rp.peer, rp.descs, peer)
        with self._lock:
            if self._preps.get(handle) is rp:  # not released meanwhile
                self._preps[handle] = new
        return new

    def transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle,
                 remote_idx: Any, notif: bytes | None = None) -> XferHandle:
        # The hot path: one call into C, which checks the pairs (indices in
        # range, equal lengths), merges runs, posts every row and progresses
        # the worker a little (a small transfer is often done on return).
        # Lookups go through dict.get (C) rather than HandleTable's Python
        # __getitem__, which only words the error.
        if self._closed:
            self._check_open()
        if notif is not None or (op is not _READ and op is not _WRITE):
            op = self._check_op(op, notif)
            notif = None if notif is None else bytes(notif)
        get = self._preps.get
        try:
            lp, rp = get(local_prep), get(remote_prep)
        except TypeError:  # unhashable: not a handle
            lp = rp = None
        if lp is None or rp is None:
            lp, rp = self._preps[local_prep], self._preps[remote_prep]  # raises InvalidHandle
        if lp.peer is not None:
            raise InvalidArgument("local_prep must come from prep(None, ...): it describes our own memory")
        if lp.retired or rp.retired:
            raise InvalidDescriptor("a prepped list of this transfer covers memory deregistered since it was "
                                    "prepped: release it, and prep the memory registered now")
        peer = self._peers.get(rp.peer) if rp.peer is not None else None
        if peer is None:
            peer = self._peer(rp.peer)
            if rp.peer is None and len(peer.keys) != len(self._regions.of(MemKind.DRAM)):
                raise InvalidArgument("registrations changed since this local prep; prep the descriptors again")
        if peer.failed is not None:
            return self._given_up(op, peer)
        if rp.owner is not peer and rp.peer is not None:
            rp = self._recheck(remote_prep, rp, peer)
        if lp.descs.kind is not rp.descs.kind:
            raise InvalidArgument(f"local {lp.descs.kind.value} and remote {rp.descs.kind.value} descriptors")
        w = peer.epoch
        try:
            stale = w is not None and w.stale
        except ValueError:  # dropped meanwhile (its watch closed): the post fails on its closed endpoint
            stale = False
        if stale:
            raise RemoteRejected(f"peer {rp.peer!r} deregistered memory since its metadata was loaded; "
                                 "re-add its metadata (it may no longer offer these rows)")
        return self._post(op, peer, lp, local_idx, rp, remote_idx, notif)

    def _post(self, op: Op, peer: _Peer, lp: _Prep, local_idx: Any, rp: _Prep, remote_idx: Any,
              notif: bytes | None) -> XferHandle:
        try:  # contiguous int64/int32 arrays (or None) go to C as they are
            nx = self._worker.post(op is _WRITE, peer.ep, lp.local, local_idx, rp.remote, remote_idx, peer.keys, notif)
        except (ValueError, BufferError, TypeError) as e:
            if peer.failed is not None:  # disconnected meanwhile (a deadline seen by another thread)
                return self._given_up(op, peer)
            li, ri = _index(local_idx), _index(remote_idx)
            if li is local_idx and ri is remote_idx:  # they were fine: the pairs are not
                raise InvalidArgument(f"cannot post this {op.value}: {e}") from None
            try:
                nx = self._worker.post(op is _WRITE, peer.ep, lp.local, li, rp.remote, ri, peer.keys, notif)
            except (ValueError, BufferError, TypeError) as e2:
                raise InvalidArgument(f"cannot post this {op.value}: {e2}") from None
            except (self._ucp.Error, RuntimeError) as e2:
                return self._post_failed(op, peer, rp.peer, e2)
        except (self._ucp.Error, RuntimeError) as e:
            return self._post_failed(op, peer, rp.peer, e)
        h = next(self._ids)  # the base class's id space (a C iterator: atomic under the GIL)
        self._xfers[h] = _Xfer(op, peer, nx, time.monotonic() + self.timeout, (lp, rp) if rp.peer is None else (lp,))
        return h  # type: ignore[return-value]  (XferHandle is an int)

    def _post_failed(self, op: Op, peer: _Peer, name: str | None, e: Exception) -> XferHandle:
        """post() found the peer's endpoint or keys closed (by another thread
        meanwhile: a deadline, remove_remote, add_remote replacing it, close),
        or the worker closed."""
        if self._closed:
            self._check_open()
        if peer.failed is not None:  # disconnected meanwhile (a deadline seen by another thread)
            return self._given_up(op, peer)
        if isinstance(e, self._ucp.Error) and len(e.args) > 1:
            raise native.error_of(e.args[1], f"{op.value} with {name!r}") from None
        raise PeerDisconnected(f"{op.value} with {name!r}: {e}") from None

    def _given_up(self, op: Op, peer: _Peer) -> XferHandle:
        """A transfer to a peer we disconnected: ERR from the start."""
        x = _Xfer(op, peer, None, 0.0)
        x.state = XferState.err(peer.failed)
        h = next(self._ids)
        self._xfers[h] = x
        return h  # type: ignore[return-value]

    def _end(self, x: _Xfer, state: XferState) -> None:
        if x.state.pending:
            x.state = state
            x.native.cancel(-16)

    def check_state(self, handle: XferHandle) -> XferState:
        if self._closed:
            self._check_open()
        try:
            x = self._xfers.get(handle)
        except TypeError:
            x = None
        if x is None:
            x = self._xfers[handle]  # raises InvalidHandle
        return self._state(x)

    def _state(self, x: _Xfer) -> XferState:
        if x.state.status is not _PROC_STATUS:
            return x.state
        st = x.native.status(x.peer.pidfd)
        if st == native.INPROGRESS:
            now = time.monotonic()
            if now > x.deadline:
                cause = TransferTimeout(f"{x.op.value} with {x.peer.md.name!r} did not complete within "
                                        f"{self.timeout:g}s")
                if x.peer is self._self:
                    self._end(x, XferState.err(cause))  # our own memory: nobody to disconnect
                else:
                    self._fail(x.peer, cause)
            elif (err := x.peer.ep.error()) != 0:  # UCX's error handling, or the pid watch, failed the peer
                self._end(x, XferState.err(native.error_of(err, f"{x.op.value} with {x.peer.md.name!r}")))
        elif st == 0:
            x.state = _DONE
        elif st == native.EXITED:
            # a cma copy from a process that exited before the pid watch noticed fails without
            # failing the flush (no peer error mode on one host): a dead peer's DONE does not count
            x.state = XferState.err(PeerDisconnected(
                f"peer {x.peer.md.name!r} (pid {x.peer.md.pid}) exited during {x.op.value}"))
        else:
            x.state = XferState.err(native.error_of(st, f"{x.op.value} with {x.peer.md.name!r}"))
        if x.peer.retired and x.state.status is not _PROC_STATUS:
            self._reap()
        return x.state

    def release(self, handle: XferHandle | PrepHandle) -> None:
        if self._closed:
            self._check_open()
        try:
            x = self._xfers.get(handle)
        except TypeError:
            x = None
        if x is not None and x.state.status is _PROC_STATUS:
            # UCX cannot call back bytes it has posted: they land (or fail) before release returns.
            # Bounded: past its deadline check_state disconnects the peer, which cancels them.
            end = x.deadline + 1.0
            while self._state(x).status is _PROC_STATUS and time.monotonic() < end:
                time.sleep(0.0002)
        x = self._xfers.pop(handle, None) if x is not None else None
        if x is None:  # a prep, or no handle at all
            take_handle(self._preps, self._xfers, handle)
            return
        if x.state.status is _PROC_STATUS:
            self._end(x, XferState.err(TransferError("released before completion")))
        if x.peer.retired:
            self._reap()

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._check_notif(msg)
        try:
            self._peer(peer).ep.notify(bytes(msg))
        except self._ucp.Error as e:
            raise native.error_of(e.args[1], f"notification to {peer!r}") from None
        except RuntimeError as e:  # the worker closed under us (close() on another thread)
            self._check_open()
            raise PeerDisconnected(f"notification to {peer!r}: {e}") from None

    def get_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        try:
            got = self._worker.take_notifs()
        except RuntimeError as e:  # as in notify
            self._check_open()
            raise TransferError(f"reading notifications: {e}") from None
        for sender, msg in got:
            self._inbox.deliver(sender.decode("utf-8", "replace"), msg)
        return self._inbox.take()

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            peers = list(self._peers.values()) + ([self._self] if self._self else []) + self._retired
            self._peers.clear()
            self._retired = []
            self._self = None
        for p in peers:
            self._drop(p, TransferError("backend closed"))
        for x in self._xfers.values():
            self._end(x, XferState.err(TransferError("backend closed")))
        self._xfers.clear()
        self._preps.clear()
        for mapped in self._mapped.values():
            for m, _ in mapped:
                if m is not None:
                    m.unmap()
        self._mapped.clear()
        self._regions.clear()
        self._worker.close()
        self._epoch.close()

