"""``nixl``: kvt's verbs on a real ``nixl_agent`` (NIXL with its UCX plugin).

Each verb is one or two ``nixl_agent`` calls; what kvt adds is bookkeeping
NIXL does not do for us (see docs/backends/nixl.md):

* int handles mapped to NIXL's handle objects, so a released or unknown
  handle is an ``InvalidHandle`` rather than a use-after-free in C++;
* descriptor lists checked against registered memory before NIXL sees them
  (for a peer, against the regions its metadata advertises);
* prepped lists re-prepped when they went stale (a peer's metadata was
  reloaded, or our own memory was deregistered), which NIXL would refuse;
* a deadline on every transfer: one still in progress after ``timeout``
  seconds turns to ``ERR`` with ``TransferTimeout``;
* every NIXL exception mapped to kvt's error tree.

The hot path (``transfer``, ``check_state``, ``release``) is a few dict and
attribute lookups around the NIXL calls, made on NIXL's pybind agent
(``nixl_agent.agent``) with integer handles: the ``nixl_agent`` wrapper's
per-call work (a dict lookup of the op, a handle object per transfer, status
enums turned into strings) costs as much as kvt's own bookkeeping.  int32
index arrays go to NIXL untouched and a few int64 ids as a list (NIXL
range-checks both, and refuses a list value too wide for an int, where it
would silently wrap a wide array); NIXL's own index and length checks run
before any byte moves, and only when NIXL refuses do we work out the precise
kvt error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np
from kvt import extensions
from kvt.backend import Backend, PeerTable, RegionTable, unknown_peer
from kvt.epoch import Epoch, EpochWatch
from kvt.errors import (BackendUnavailable, ClosedError, ConfigError, IncompatiblePeer, InvalidArgument,
                        InvalidDescriptor, InvalidHandle, PeerDisconnected, RemoteRejected, TransferError,
                        TransferTimeout, UnknownPeer, WireError)
from kvt.procs import host_id
from kvt.types import (Availability, Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle,
                       XferHandle, XferState, as_index)
from kvt.ucxkeys import LOOPBACK, cross_host_refused, loopback_default

from . import native, vet
from .metadata import NixlMetadata, epoch_watch, pack, tables, unpack, vouched
from .options import OPTION_NAMES, parse_options

__all__ = ["NixlBackend"]

log = logging.getLogger(__name__)

# module constants: enum members and dtypes are slow to look up on a microsecond path
_PROC, _DONE = XferState.PROC, XferState.DONE
_READ, _WRITE = Op.READ, Op.WRITE
_ND, _I32, _I64 = np.ndarray, np.dtype(np.int32), np.dtype(np.int64)
_FEW = 16  # up to this many int64 ids go to NIXL as a list: cheaper than a checked numpy cast

# the hot path's common case in C (kvt_nixl/_fastpath.c); NixlBackend._transfer and _check_state are
# its pure-Python twins, and take every other case (KVT_NATIVE=0 forces them, as for kvt's own)
_fastpath, _POST_PATH = extensions.load("kvt_nixl._fastpath", "kvt-nixl", "pure-Python post path")
_NEVER = float("inf")
_MAX_ROWS = 2**31 - 1  # NIXL indexes descriptors with 32-bit ints
#: removed peers kept loaded in NIXL for a re-add (see NixlBackend._parked); past it the oldest is unloaded
MAX_PARKED = 1024


class _PyPrepCore:
    __slots__ = ("peer", "descs", "side", "target", "old", "_all", "epoch", "released")


class _PyNixlCore:
    __slots__ = ()


_PrepCore, _NixlCore = (_PyPrepCore, _PyNixlCore) if _fastpath is None else (_fastpath.PrepCore, _fastpath.NixlCore)


class _Prep(_PrepCore):
    """A prepped list and NIXL's handles for it.

    ``side`` is the handle for when the list is the local side of a
    transfer (our own lists only); ``target`` for when it is the remote
    side (a peer's list, or our own prepped again for a local transfer,
    made on first use).  ``None`` sends the transfer down the slow path,
    which (re)preps or says why not.  Handles made stale by a reload or a
    deregistration stay alive in ``old`` until the prep is released: another
    thread may be posting with them at this very moment."""

    __slots__ = ()

    def __init__(self, peer: str | None, descs: Descs, epoch: EpochWatch | None = None):
        self.peer, self.descs, self.epoch = peer, descs, epoch  # epoch: a same-host peer's (kvt.epoch)
        self.side = self.target = self._all = None
        self.released = False  # set (under _lock) by release: the slow path must not re-prep it
        self.old: list[Any] = []

    def retire(self) -> None:
        self.old += [h for h in (self.side, self.target) if h is not None]
        self.side = self.target = None

    def all_rows(self) -> np.ndarray:
        if self._all is None:
            self._all = np.arange(len(self.descs), dtype=np.int32)
        return self._all


class _Xfer:
    """A transfer that did not finish within its post: NIXL's handle (an int,
    None once freed), its peer, when it turns to TransferTimeout, its state."""

    __slots__ = ("handle", "peer", "deadline", "state")

    def __init__(self, handle: Any, peer: str | None, state: XferState = _PROC):
        self.handle, self.peer, self.deadline, self.state = handle, peer, _NEVER, state


class NixlBackend(_NixlCore, Backend):
    """kvt backend over ``nixl._api.nixl_agent``.

    Options (all optional): ``backends`` (NIXL plugins, default
    ``["UCX"]``), ``num_threads``, ``progress_thread`` (default on), ``progress_delay_us`` (default 1000),
    ``notif_quiet_us`` (default 10000),
    ``ucx_env`` (UCX_* settings for this agent, e.g. ``UCX_TLS``),
    ``backend_params`` (per-plugin NIXL init parameters), ``timeout``
    (seconds, default 30).  See docs/backends/nixl.md.
    """

    capabilities = Capabilities(
        mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM} if native.cuda_present() else {MemKind.DRAM}),
        ops=frozenset(Op), notifications=True, local=True, remote=True, cross_host=True,
        max_notif_bytes=1 << 20, cross_host_options={"ucx_env": {"UCX_TLS": "tcp"}}, owner_check="transport",
        # NIXL cannot stop an RMA in flight (its disconnect waits for it): a READ that kvt's deadline
        # ended can still land when a stalled peer resumes (docs/backends/nixl.md)
        stops_on_err=False)
    option_names = OPTION_NAMES  # docs/backends/nixl.md
    post_path = extensions.summary(_fastpath, _POST_PATH)

    @classmethod
    def availability(cls) -> Availability:
        return native.availability()

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        opts = parse_options(options or {})  # before the base class reads 'timeout'
        super().__init__(agent_name, options)
        self.timeout = opts.timeout
        # without the progress thread NIXL's getNotifs is what progresses a target: ask it every time
        self._notif_quiet = opts.notif_quiet_us / 1e6 if opts.progress_thread else 0.0
        self._notifs_after = 0.0  # monotonic time before which get_notifs does not ask NIXL
        avail = native.availability()
        if not avail.usable:
            raise BackendUnavailable(f"nixl backend cannot run here: {avail.reason}")
        # what new_agent makes the agent from, also the settings of the sandbox that loads peers' blobs first
        self._settings = {"backends": opts.backends, "num_threads": opts.num_threads, "env": _ucx_env(opts.ucx_env),
                          "params": {b: {k: str(v) for k, v in p.items()} for b, p in opts.backend_params.items()}}
        s = self._settings
        self._agent = native.new_agent(agent_name, s["backends"], s["params"], s["num_threads"],
                                       opts.progress_thread, s["env"], opts.progress_delay_us)
        self._lock = threading.RLock()                   # guards everything but the hot path
        # NIXL runs in NIXL_THREAD_SYNC_NONE mode (see native.new_agent): kvt serializes its own
        # calls into NIXL with this lock, held around each call only (never while taking _lock).
        # It also guards the lifetime of NIXL's handles: a NIXL handle is freed only under it, after
        # kvt's reference to it was retired (_Prep.retire) or cleared (_Xfer.handle = None), and the
        # hot path re-checks, under it, that the handles it read are still current (and the backend
        # open) before handing them to NIXL; _xfers changes only under it.  close() holds it
        # throughout its teardown.
        self._nixl = threading.Lock()
        self._regions = RegionTable()                    # what we registered, by handle and by kind
        self._regs: dict[int, Any] = {}                  # handle -> NIXL's reg list (None: an empty one)
        self._peers = PeerTable()                        # name -> the regions it advertised
        self._epoch = Epoch()                            # bumped by deregister, watched by same-host peers
        self._watches: dict[str, EpochWatch | None] = {}  # same-host peers' epochs
        self._blobs: dict[str, bytes] = {}               # name -> its NIXL metadata (a new one: it restarted)
        # removed peers NIXL still has loaded, name -> blob (oldest first): NIXL keeps a removed
        # agent's UCX connection open at both ends until close, so a remove_remote_agent per
        # remove_peer piled up a socket per remove/add cycle; re-adding a parked blob reuses it
        self._parked: dict[str, bytes] = {}
        # peers a transfer timed out with, name -> the cause every other transfer with them ends with
        # at once, until add_remote loads them again (not one timeout per queued transfer)
        self._silent: dict[str, TransferError] = {}
        self._preps: dict[int, _Prep] = {}
        self._xfers: dict[int, Any] = {}                 # handle -> _Xfer, or NIXL's handle alone
                                                         # for a transfer that finished within its post
        self._leaked: list[Any] = []                     # NIXL handles it would not free yet
        self._own_blob: bytes | None = None              # our NIXL metadata, to check peers' against
        self._publish()
        # NIXL's pybind agent, its verbs bound once: attribute lookups show on the microsecond hot path
        self._bind = bind = self._agent.agent
        self._make, self._post, self._status = bind.makeXferReq, bind.postXferReq, bind.getXferStatus
        self._free = bind.releaseXferReq
        nb = native.api().nixlBind
        self._read, self._write = nb.NIXL_READ, nb.NIXL_WRITE
        self._ok, self._inprog = nb.NIXL_SUCCESS, nb.NIXL_IN_PROG
        if _fastpath is not None:  # where the C post path copies a few int64 ids for NIXL (under _nixl)
            self._scratch = tuple(tuple(np.empty(n, np.int32) for n in range(1, _FEW + 1)) for _side in "lr")

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Any) -> RegHandle:
        self._check_open()
        descs = Descs.coerce(mem)
        self._check_kind(descs.kind)
        reg = None
        if len(descs):  # NIXL cannot register an empty list; kvt allows it
            try:
                with self._nixl:
                    reg = self._agent.register_memory(descs.array, descs.kind.value)
            except Exception as e:
                self._check_open()  # closed by another thread meanwhile: say so
                raise native.translate(e, f"registering {len(descs)} {descs.kind.value} regions",
                                       InvalidArgument) from e
        with self._lock:
            self._check_open()  # closed meanwhile: the agent and its registrations are gone
            h = self._next_id()
            self._regs[h] = reg
            self._regions.add(h, descs)
            self._publish()
        return RegHandle(h)

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        with self._lock:
            try:
                reg = self._regs.get(handle)
            except TypeError:  # unhashable: not one of ours
                reg = None
            if reg is not None:
                # lists prepped over it hold NIXL pointers into the registration: retire them before
                # NIXL frees it (a transfer re-checks under _nixl, then re-preps, i.e. re-checks, them)
                self._retire(lambda p: p.peer is None)
                self._settle_in_flight()
                try:
                    with self._nixl:
                        self._agent.deregister_memory(reg)
                except Exception as e:
                    self._check_open()  # closed by another thread meanwhile: say so
                    raise native.translate(e, f"deregistering handle {handle}", InvalidArgument) from e
            self._regions.remove(handle)  # InvalidHandle if there is no such registration
            del self._regs[handle]
            # UCX's same-host copies (cma) ignore remote keys: same-host peers watch this instead
            self._epoch.bump()
            self._publish()
            self._retire(lambda p: p.peer is None)  # they may point into it: re-check before use

    # -- peers ----------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        vet.start(self._settings)  # peers are coming: have the sandbox up before their metadata
        try:
            with self._nixl:
                blob = self._agent.get_agent_metadata()
        except Exception as e:
            self._check_open()  # closed by another thread meanwhile: say so
            raise native.translate(e, "reading our NIXL metadata", TransferError) from e
        with self._lock:  # the tables _publish vouched for
            return pack(self.agent_name, blob, tables(self._regions.by_kind()), self._epoch.value, self._epoch.fd)

    def _own(self) -> bytes:
        """Our NIXL blob as it was first read: its connection records are what
        peers check theirs against and what our epoch page vouches for."""
        if self._own_blob is None:
            try:
                with self._nixl:
                    self._own_blob = self._agent.get_agent_metadata()
            except Exception as e:
                self._check_open()  # closed by another thread meanwhile: say so
                raise native.translate(e, "reading our NIXL metadata", TransferError) from e
        return self._own_blob

    def _publish(self) -> None:
        """Vouch on our epoch page for the region tables our metadata carries
        from now on, with our connection records (call holding the lock, or
        in __init__): a same-host peer refuses metadata claiming other memory
        of us, or pairing our pid with another process's addresses (kvt.epoch)."""
        self._epoch.publish(vouched(tables(self._regions.by_kind()), self._own()))

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        md, regions, vouch = unpack(metadata, self._own())  # our connection records: the format a peer's must match
        if md.name == self.agent_name:
            raise InvalidArgument(f"metadata is this agent's own ({md.name!r}); local transfers use prep(None, ...)")
        if md.host_id != host_id() and self._settings["env"].get("UCX_NET_DEVICES") == LOOPBACK:
            raise ConfigError(cross_host_refused(md.name, 'ucx_env = {UCX_NET_DEVICES = "eth0"}'))
        if md.nixl not in (self._blobs.get(md.name), self._parked.get(md.name)):  # loaded before: vetted then
            vet.vet(self._settings, md.nixl, md.name)
        watch = epoch_watch(md, vouch)  # on this host: only metadata its owner vouches for
        try:
            return self._load(md, regions, watch)
        except BaseException:
            if watch is not None:
                watch.close()
            raise

    def _load(self, md: NixlMetadata, regions: dict, watch: EpochWatch | None) -> str:
        """``add_remote`` of checked metadata (``watch``: its owner's epoch, on this host)."""
        with self._lock:
            self._check_open()
            parked = self._parked.pop(md.name, None)
            if parked is not None and parked != md.nixl:  # removed, then restarted: NIXL forgets the old one
                self._unload(md.name)
                parked = None
            if md.name in self._peers and self._blobs.get(md.name) != md.nixl:
                # a restarted peer (same name, new process): NIXL would keep talking to the old
                # one, so forget it first; what was in flight to it ends ERR
                self._drop_peer(md.name, PeerDisconnected(f"peer {md.name!r} restarted (new process); "
                                                          "this transfer was meant for the old one"))
            if md.name in self._peers:  # NIXL refuses lists prepped before a reload: retire them first
                self._retire(lambda p: p.peer == md.name)
            try:
                with self._nixl:
                    name = self._agent.add_remote_agent(md.nixl)
            except Exception as e:
                if parked is not None:  # still loaded in NIXL as it was: parked again (close unloads it)
                    self._parked[md.name] = parked
                # undecodable is a WireError; decodable but unreachable (no UCX transport in
                # common, e.g. UCX_TLS differs) cannot be paired with us
                raise native.translate(e, f"loading the NIXL metadata of {md.name!r}", WireError,
                                       {"NIXL_ERR_BACKEND": IncompatiblePeer}) from e
            if name not in (md.name, md.name.encode()):
                # never leave a half-loaded peer behind (unless it is one we had loaded before)
                if md.name not in self._peers:
                    for n in {name, md.name}:
                        try:
                            with self._nixl:
                                self._agent.remove_remote_agent(n)
                        except Exception:  # noqa: BLE001 - not loaded under that name
                            pass
                raise WireError(f"metadata says agent {md.name!r} but its NIXL part belongs to {name!r}")
            name = md.name
            self._peers[name], self._blobs[name] = regions, md.nixl
            self._silent.pop(name, None)  # loaded again: given another chance
            old, self._watches[name] = self._watches.get(name), watch
            self._retire(lambda p: p.peer == name)  # NIXL refuses lists prepped before a reload
            for p in self._preps.values():
                if p.peer == name:
                    p.epoch = watch
            if old is not None:  # its open of the peer's epoch page
                old.close()
        return name

    def remove_remote(self, peer: str) -> None:
        self._check_open()
        with self._lock:
            self._known(peer)
            blob = self._blobs.get(peer)
            self._drop_peer(peer, PeerDisconnected(f"peer {peer!r} was removed"), unload=blob is None)
            if blob is not None:
                self._parked[peer] = blob
                while len(self._parked) > MAX_PARKED:  # the oldest goes from NIXL (its socket stays: NIXL's)
                    oldest = next(iter(self._parked))
                    del self._parked[oldest]
                    self._unload(oldest)

    def _known(self, peer: Any) -> None:
        """``UnknownPeer`` unless ``peer`` is loaded (also for an unhashable name)."""
        try:
            self._peers[peer]
        except TypeError:
            raise unknown_peer(repr(peer), self._peers) from None

    def _drop_peer(self, peer: str, cause: TransferError, unload: bool = True) -> None:
        """Forget ``peer`` here (and, with ``unload``, in NIXL); its transfers in flight end with ``cause``."""
        with self._lock:
            del self._peers[peer]
            self._blobs.pop(peer, None)
            self._silent.pop(peer, None)
            watch = self._watches.pop(peer, None)
            # first its lists (no transfer posts on them past this), then the transfers posted on them
            self._retire(lambda p: p.peer == peer)
            if watch is not None:
                for p in self._preps.values():
                    if p.epoch is watch:
                        p.epoch = None
                watch.close()  # its open of the peer's epoch page (a post racing this: see _stale)
            with self._nixl:
                xfers = [x for x in self._xfers.values() if x.__class__ is _Xfer and x.peer == peer]
            for x in xfers:
                if x.state is _PROC:
                    self._poll(x)
                    if x.state is _PROC:
                        x.state = XferState.err(cause)
                        self._free_xfer(x, wait=False)
            if unload:
                self._unload(peer)

    def _unload(self, peer: str) -> None:
        with self._nixl:
            try:
                self._agent.remove_remote_agent(peer)  # returns a status; nothing to undo either way
            except Exception as e:  # noqa: BLE001 - not loaded (any more): nothing to unload
                log.debug("NIXL would not unload %r: %s", peer, native.status_name(e))

    # -- prep -----------------------------------------------------------------

    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        descs = self._prep_descs(descs)
        if len(descs) > _MAX_ROWS:
            raise InvalidArgument(f"{len(descs)} descriptors in one list; NIXL takes at most {_MAX_ROWS}")
        peer = None if peer == self.agent_name else peer
        if peer is not None:
            self._known(peer)
        p = _Prep(peer, descs, self._watches.get(peer) if peer is not None else None)
        with self._lock:
            self._check_open()  # close() may have run since the caller's check
            self._check_within(p)
            if p.peer is None:
                p.side = self._native_prep(native.INIT_AGENT, descs)
            else:
                p.target = self._native_prep(p.peer, descs)
            h = self._next_id()
            self._preps[h] = p
        return PrepHandle(h)

    def _check_within(self, p: _Prep) -> None:
        """``p``'s rows must lie in memory its owner registered (for a peer:
        as its metadata tells); ``UnknownPeer`` if it is not loaded (any more)."""
        kind = p.descs.kind
        if p.peer is None:
            self._within(p.descs, self._regions.of(kind), None)
            return
        self._within(p.descs, self._peers[p.peer].get(kind), p.peer)

    def _native_prep(self, agent: str, descs: Descs) -> Any:
        if not len(descs):
            return None  # NIXL cannot prep an empty list; transfers on it move nothing
        try:
            with self._nixl:
                return self._agent.prep_xfer_dlist(agent, descs.array, descs.kind.value)
        except Exception as e:
            self._check_open()  # closed by another thread meanwhile: say so
            raise native.translate(e, f"prepping {len(descs)} descriptors for {agent}", InvalidDescriptor) from e

    def _settle_in_flight(self) -> None:
        """Before memory leaves NIXL: wait until none of our transfers is in
        flight (the caller frees the memory next).  NIXL's records do not
        say which memory each moves, so every one, as ``release`` waits for
        one: it lands, fails or misses its deadline (bounded by ``timeout``)."""
        for x in [x for x in list(self._xfers.values()) if x.__class__ is _Xfer]:
            while x.state is _PROC and x.handle is not None:
                self._poll(x)
                if x.state is _PROC:
                    time.sleep(0.0002)

    def _retire(self, match: Callable[[_Prep], bool]) -> None:
        for p in self._preps.values():
            if match(p):
                p.retire()

    def _sides(self, lp: _Prep, rp: _Prep) -> tuple[Any, Any]:
        """The slow path to the two NIXL handles of a transfer: checks the
        pairing, re-checks and re-preps stale lists, makes a loopback target."""
        if lp.peer is not None:
            raise InvalidArgument("local_prep must come from prep(None, ...): it describes our own memory")
        with self._lock:
            self._check_open()
            if lp.released or rp.released:  # released by another thread meanwhile
                raise InvalidHandle("the prepped list was released while this transfer was being posted")
            if lp.side is None:
                self._check_within(lp)
                lp.side = self._native_prep(native.INIT_AGENT, lp.descs)
            if rp.target is None:
                self._check_within(rp)
                rp.target = self._native_prep(rp.peer or self.agent_name, rp.descs)
            return lp.side, rp.target

    def _free_prep(self, p: _Prep, locked: bool = False) -> None:
        """Free ``p``'s NIXL lists (``locked``: the caller holds ``_nixl``)."""
        p.released = True
        p.retire()
        for h in p.old:
            try:
                if locked:
                    self._agent.release_dlist_handle(h)
                else:
                    with self._nixl:
                        self._agent.release_dlist_handle(h)
            except Exception as e:  # nothing the caller can do; NIXL frees it at close
                log.warning("NIXL would not release a prepped list: %s", native.status_name(e))
        p.old.clear()

    # -- transfers ------------------------------------------------------------

    def _transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle,
                  remote_idx: Any, notif: bytes | None = None) -> XferHandle:
        # The hot path: only what NIXL does not check itself; argument errors
        # NIXL finds are explained precisely in _refused.  (With the C post path,
        # the cases its common one does not cover.)
        if self._closed:
            self._check_open()
        if notif is not None or (op is not _READ and op is not _WRITE):
            op = self._check_op(op, notif)
            if notif is not None:
                if not len(notif):
                    raise InvalidArgument("NIXL cannot attach an empty notification to a transfer (it means "
                                          "'none'); send a non-empty message, or notify() separately")
                notif = bytes(notif)  # NIXL takes bytes, not bytearray or memoryview
        try:
            lp, rp = self._preps[local_prep], self._preps[remote_prep]
        except (KeyError, TypeError):
            self._check_open()  # closed by another thread meanwhile
            raise InvalidHandle(f"no prepped list with handle {local_prep!r} or {remote_prep!r} (released?)") from None
        if self._silent and rp.peer in self._silent:
            return self._failed_at_once(rp.peer)
        if rp.epoch is not None and _stale(rp.epoch):
            raise RemoteRejected(f"peer {rp.peer!r} deregistered memory since its metadata was loaded; "
                                 "re-add its metadata (it may no longer offer these rows)")
        lside, rside = lp.side, rp.target
        if lside is None or rside is None:
            lside, rside = self._sides(lp, rp)
        try:  # int32 arrays go to NIXL as they are, a few int64 ids as lists (see the module's doc)
            dl, dr = local_idx.dtype, remote_idx.dtype
            if dl is _I32 and dr is _I32:
                li, ri = local_idx, remote_idx
            elif dl is _I64 and dr is _I64 and local_idx.size <= _FEW and type(local_idx) is _ND \
                    and type(remote_idx) is _ND and local_idx.ndim == 1 and remote_idx.ndim == 1:
                li, ri = local_idx.tolist(), remote_idx.tolist()
            else:
                li, ri = _rows(local_idx, lp, "local_idx"), _rows(remote_idx, rp, "remote_idx")
        except AttributeError:  # None, lists
            li, ri = _rows(local_idx, lp, "local_idx"), _rows(remote_idx, rp, "remote_idx")
        while True:
            perr = xh = None
            with self._nixl:  # one hold for both calls and the record (see __init__)
                # another thread may have closed the backend, or retired (and then freed) these lists
                # (a deregistration, a peer removed or reloaded, a prep released) since we read them
                if self._closed or lp.side is not lside or rp.target is not rside:
                    stale = True
                else:
                    stale = False
                    try:
                        xh = self._make(self._read if op is _READ else self._write, lside._handle, li,
                                        rside._handle, ri, notif or b"", [], False)
                    except Exception as e:
                        perr = e
                    else:
                        s = None
                        try:
                            s = self._post(xh, b"")
                        except Exception as e:  # e.g. the peer is already gone
                            perr = e
                        # small or same-host (cma) copies finish within the post: NIXL's int handle
                        # alone is the cheapest record of that
                        x = xh if perr is None and s == self._ok else self._record(xh, s, perr, op, rp)
                        h = next(self._ids)  # the base class's id space (a C iterator: atomic under the GIL)
                        self._xfers[h] = x
            if not stale:
                break
            if self._closed:
                self._check_open()
            lside, rside = self._sides(lp, rp)  # re-checks and re-preps, or says why not
        if xh is None:
            return self._refused(perr, op, lp, li, rp, ri, notif)
        return h  # type: ignore[return-value]  (XferHandle is an int)

    def _record(self, xh: Any, s: Any, perr: Exception | None, op: Op, rp: _Prep) -> _Xfer:
        """The record of a posted transfer that did not finish within its
        post (``s``: its status; ``perr``: why the post raised); the caller
        holds ``_nixl``."""
        if perr is not None:
            return _Xfer(xh, rp.peer, XferState.err(native.translate(
                perr, f"posting a {op.value} to {rp.peer or 'this agent'}", TransferError)))
        x = _Xfer(xh, rp.peer)
        if s != self._inprog:
            self._poll_locked(x)  # NIXL says why when asked
        else:
            x.deadline = time.monotonic() + self.timeout
        return x

    def _refused(self, e: Exception, op: Op, lp: _Prep, li: Any, rp: _Prep, ri: Any,
                 notif: bytes | None) -> XferHandle:
        """NIXL would not create the transfer: the precise kvt error when the
        arguments are at fault; a transfer of no rows (which NIXL refuses)
        is DONE at once, its notification still delivered."""
        if type(li) is list:  # the few-ids path: check them as arrays
            li, ri = np.asarray(li, np.int64), np.asarray(ri, np.int64)
        self._pair(lp.descs, li, rp.descs, ri)  # raises InvalidArgument naming what is wrong
        if li.size:
            raise native.translate(e, f"creating a {op.value} of {li.size} descriptors", InvalidArgument) from e
        if notif is not None:
            self._send_notif(rp.peer or self.agent_name, notif)
        with self._nixl:
            if self._closed:
                self._check_open()
            h = next(self._ids)
            self._xfers[h] = _Xfer(None, rp.peer, _DONE)
        return h  # type: ignore[return-value]

    def _failed_at_once(self, peer: str) -> XferHandle:
        """A transfer with a peer that stopped answering: ERR from the start."""
        with self._nixl:
            if self._closed:
                self._check_open()
            h = next(self._ids)
            self._xfers[h] = _Xfer(None, peer, XferState.err(self._silent.get(peer) or PeerDisconnected(
                f"peer {peer!r} stopped answering; re-add its metadata to try again")))
        return h  # type: ignore[return-value]

    def _check_state(self, handle: XferHandle) -> XferState:
        if self._closed:
            self._check_open()
        try:
            x = self._xfers[handle]
        except (KeyError, TypeError):
            self._check_open()  # closed by another thread meanwhile
            raise InvalidHandle(f"no transfer with handle {handle!r} (released?)") from None
        if x.__class__ is not _Xfer:  # NIXL's handle alone: DONE within its post
            return _DONE
        if x.state is _PROC:
            self._poll(x)
            if x.handle is None and x.state is _PROC:  # released or closed by another thread meanwhile
                self._check_open()
                raise InvalidHandle(f"no transfer with handle {handle!r} (released meanwhile)")
        return x.state

    if _fastpath is None:  # else NixlCore's, which hand what they do not cover to these
        transfer, check_state = _transfer, _check_state

    def _poll(self, x: _Xfer) -> None:
        with self._nixl:
            self._poll_locked(x)

    def _poll_locked(self, x: _Xfer) -> None:
        """Ask NIXL once (the caller holds ``_nixl``); enforce the deadline
        NIXL does not have.  A handle freed meanwhile is not asked about."""
        if x.handle is None or x.state is not _PROC:
            return
        try:
            s = self._status(x.handle)
        except Exception as e:
            x.state = XferState.err(native.translate(e, f"transfer with {x.peer or 'this agent'}", TransferError))
            return
        if s == self._ok:
            x.state = _DONE
        elif s != self._inprog:
            x.state = XferState.err(TransferError(f"NIXL reported ERR for a transfer with {x.peer or 'this agent'}"))
        elif x.peer is not None and x.peer in self._silent:  # another transfer with it timed out
            x.state = XferState.err(self._silent[x.peer])
        elif time.monotonic() > x.deadline:
            x.state = XferState.err(TransferTimeout(
                f"transfer with {x.peer or 'this agent'} still in progress after {self.timeout:g}s "
                "(option 'timeout'); is the peer alive and progressing?"))
            if x.peer is not None:
                self._silent[x.peer] = PeerDisconnected(
                    f"peer {x.peer!r} stopped answering (a transfer with it made no progress for {self.timeout:g}s); "
                    "re-add its metadata to try again")

    def release(self, handle: XferHandle | PrepHandle) -> None:
        if self._closed:
            self._check_open()
        with self._nixl:  # one owner per record: close() and _drop_peer take them under it too
            if self._closed:
                raise ClosedError(f"backend {type(self).__name__} of agent {self.agent_name!r} is closed")
            try:
                x = self._xfers.pop(handle, None)
            except TypeError:  # unhashable: not one of ours
                raise InvalidHandle(f"no transfer or prep with handle {handle!r}") from None
            if x is not None and x.__class__ is not _Xfer:  # finished within its post
                try:
                    self._free(x)
                except Exception:  # not expected of a finished transfer; retried at close
                    self._leaked.append(x)
                return
        if x is None:
            with self._lock:
                self._check_open()
                try:
                    p = self._preps.pop(handle, None)
                except TypeError:  # unhashable (an empty dict does not even hash it)
                    p = None
                if p is None:
                    raise InvalidHandle(f"no transfer or prep with handle {handle!r} (released twice?)")
                self._free_prep(p)
        elif x.handle is not None:
            # NIXL cannot call back bytes it has posted (its release only cancels what has not
            # started): they land, fail or miss the deadline (bounded) before release returns
            while x.state is _PROC and x.handle is not None:
                self._poll(x)
                if x.state is _PROC:
                    time.sleep(0.0002)
            self._free_xfer(x, wait=True)

    def _free_xfer(self, x: _Xfer, wait: bool) -> None:
        """Release NIXL's handle.  NIXL cancels what it can; one it cannot
        free yet is waited for (``wait``, bounded by ``timeout``), then kept
        to retry at ``close``.  ``x.handle`` is read, freed and cleared under
        ``_nixl``: whoever gets there first frees it, exactly once."""
        end = time.monotonic() + (self.timeout if wait else 0.0)
        while True:
            with self._nixl:
                h = x.handle
                if h is None:  # freed by another thread (a peer dropped, close)
                    return
                if self._free is None:  # closed: NIXL's destructor has it
                    x.handle = None
                    return
                try:
                    self._free(h)
                except Exception:
                    if time.monotonic() >= end:
                        self._leaked.append(h)
                        x.handle = None
                        return
                    try:
                        self._status(h)  # lets NIXL progress it
                    except Exception:
                        pass
                else:
                    x.handle = None
                    return
            time.sleep(0.001)

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._check_notif(msg)
        self._known(peer)
        self._send_notif(peer, msg)

    def _send_notif(self, peer: str, msg: bytes) -> None:
        try:
            with self._nixl:
                self._agent.send_notif(peer, bytes(msg))
        except Exception as e:
            self._check_open()  # closed by another thread meanwhile: say so
            raise native.translate(e, f"notifying {peer!r}", TransferError, {"NIXL_ERR_NOT_FOUND": UnknownPeer}) from e

    def get_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        if self._notif_quiet:
            now = time.monotonic()
            if now < self._notifs_after:
                return {}  # asked again right after finding nothing (an engine's step loop)
        try:
            with self._nixl:
                got = self._agent.get_new_notifs()
        except Exception as e:
            self._check_open()  # closed by another thread meanwhile: say so
            raise native.translate(e, "fetching notifications", TransferError) from e
        # NIXL delivers messages of any size, from any agent that loaded our metadata (kvt or
        # not): what no kvt peer may send goes no further, as on the other backends
        limit = self.capabilities.max_notif_bytes
        for sender, msgs in got.items():
            if any(len(m) > limit for m in msgs):
                got[sender] = kept = [m for m in msgs if len(m) <= limit]
                log.debug("dropped %d notification(s) over %d bytes from %r", len(msgs) - len(kept), limit,
                          sender[:64])
        if self._notif_quiet:
            self._notifs_after = 0.0 if got else now + self._notif_quiet
        return {s: m for s, m in got.items() if m}

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Release every handle, registration and peer, then the NIXL agent.
        Idempotent; never raises.  Holds ``_nixl`` throughout, so that no
        other thread's NIXL call (or free) interleaves with the teardown: one
        that started first completes first, one that comes after finds the
        backend closed."""
        if self._closed:
            return
        self._closed = True
        with self._lock, self._nixl:
            for x in self._xfers.values():
                if x.__class__ is _Xfer:
                    h, x.handle = x.handle, None  # a thread still polling it now leaves NIXL alone
                else:
                    h = x
                if h is not None:
                    self._leaked.append(h)
            self._xfers.clear()
            for p in self._preps.values():
                self._free_prep(p, locked=True)
            for reg in self._regs.values():
                if reg is not None:
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception as e:
                        log.warning("NIXL would not deregister memory at close: %s", native.status_name(e))
            for peer in [*self._peers, *self._parked]:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass
            self._parked.clear()
            for h in self._leaked:  # last try; the agent's destructor gets the rest
                try:
                    self._free(h)
                except Exception:
                    pass
            self._preps.clear()
            self._regs.clear()
            for w in self._watches.values():
                if w is not None:
                    w.close()
            self._watches.clear()
            self._epoch.close()
            self._regions.clear()
            self._peers.clear()
            self._leaked.clear()
            # the last references: NIXL's destructor stops its threads
            self._agent = self._bind = self._make = self._post = self._status = self._free = None


def _stale(watch: EpochWatch) -> bool:
    try:
        return watch.stale
    except ValueError:  # closed meanwhile (the peer was dropped): the post fails on the unloaded peer
        return False


def _ucx_env(given: Mapping[str, Any]) -> dict[str, str]:
    """The UCX settings the agent's backends are created with: the option's,
    over kvt's defaults.  On a host without GPUs, ``UCX_MEM_EVENTS=no``: UCX
    otherwise hooks every ``mmap``/``munmap``/``brk`` of the process (to keep
    its registration cache right), and an engine's allocator then runs its
    forward pass markedly slower (measured with vLLM on CPU: the decode step
    after a load 11-37 ms with the hooks, 8-13 ms without).  kvt registers
    its memory explicitly, so nothing it does needs that cache; with GPUs the
    hooks also track device allocations, so they stay."""
    env = {} if native.cuda_present() else {"UCX_MEM_EVENTS": "no"}
    env.update({k: str(v) for k, v in given.items()})
    if loopback_default(env, "UCX_NET_DEVICES"):  # UCX's tcp serves any address: kvt.ucxkeys
        env["UCX_NET_DEVICES"] = LOOPBACK
    return env


def _rows(idx: Any, prep: _Prep, what: str) -> np.ndarray:
    """Row indices as the int32 array NIXL takes.  One already (an int32
    numpy array) passes as it is: NIXL checks its range and shape.  Others
    are validated first, since NIXL would silently wrap wider integers."""
    if idx is None:
        return prep.all_rows()
    if getattr(idx, "dtype", None) is _I32 and type(idx) is _ND:
        return idx
    return as_index(idx, len(prep.descs), what).astype(np.int32)


if _fastpath is not None:
    _fastpath.setup(_READ, _WRITE, _Xfer, _DONE, np.ndarray)
