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

The hot path (``transfer``, ``check_state``, ``release``) stays a few dict
lookups around the NIXL calls: int32 index arrays go to NIXL untouched, and
NIXL's own index and length checks run before any byte moves; only when
NIXL refuses do we work out the precise kvt error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

import numpy as np
from kvt.backend import Backend
from kvt.errors import (BackendUnavailable, InvalidArgument, InvalidDescriptor, InvalidHandle,
                        PeerDisconnected, TransferError, TransferTimeout, UnknownPeer, WireError)
from kvt.types import (Availability, Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle,
                       XferHandle, XferState, as_index)

from . import native
from .metadata import pack, unpack
from .options import parse_options

__all__ = ["NixlBackend"]

log = logging.getLogger(__name__)

_PROC, _DONE = XferState.PROC, XferState.DONE
_I32 = np.dtype(np.int32)
_MAX_ROWS = 2**31 - 1  # NIXL indexes descriptors with 32-bit ints


class _Prep:
    """A prepped list.  ``side`` is NIXL's handle for it: our side for
    ``peer=None``, else the peer's.  ``loop`` is our list prepped again as
    the target of a local transfer (NIXL wants both), made on first use.
    ``gen`` is the generation of the peer (or of our registrations) it was
    prepped against; a newer one means re-prep before use."""

    __slots__ = ("peer", "descs", "side", "loop", "gen", "_all")

    def __init__(self, peer: str | None, descs: Descs, side: Any, gen: int):
        self.peer, self.descs, self.side, self.loop, self.gen, self._all = peer, descs, side, None, gen, None

    def all_rows(self) -> np.ndarray:
        if self._all is None:
            self._all = np.arange(len(self.descs), dtype=np.int32)
        return self._all


class _Xfer:
    __slots__ = ("handle", "peer", "deadline", "state")

    def __init__(self, handle: Any, peer: str | None, deadline: float, state: XferState = _PROC):
        self.handle, self.peer, self.deadline, self.state = handle, peer, deadline, state


class _Peer:
    __slots__ = ("regions", "gen")

    def __init__(self, regions: dict[MemKind, Descs], gen: int):
        self.regions, self.gen = regions, gen


class NixlBackend(Backend):
    """kvt backend over ``nixl._api.nixl_agent``.

    Options (all optional): ``backends`` (NIXL plugins, default
    ``["UCX"]``), ``num_threads``, ``progress_thread`` (default on),
    ``ucx_env`` (UCX_* settings for this agent, e.g. ``UCX_TLS``),
    ``backend_params`` (per-plugin NIXL init parameters), ``timeout``
    (seconds, default 30).  See docs/backends/nixl.md.
    """

    capabilities = Capabilities(
        mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM} if native.cuda_present() else {MemKind.DRAM}),
        ops=frozenset(Op), notifications=True, local=True, remote=True, cross_host=True,
        max_notif_bytes=1 << 20)

    @classmethod
    def availability(cls) -> Availability:
        return native.availability()

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        opts = parse_options(options or {})  # before the base class reads 'timeout'
        super().__init__(agent_name, options)
        self.timeout = opts.timeout
        avail = native.availability()
        if not avail.usable:
            raise BackendUnavailable(f"nixl backend cannot run here: {avail.reason}")
        self._agent = native.new_agent(
            agent_name, opts.backends, {b: {k: str(v) for k, v in p.items()} for b, p in opts.backend_params.items()},
            opts.num_threads, opts.progress_thread, {k: str(v) for k, v in opts.ucx_env.items()})
        self._lock = threading.RLock()
        self._gens = iter(range(1, 1 << 62))
        self._local_gen = 0                              # bumped by every deregister
        self._regs: dict[int, tuple[Descs, Any]] = {}    # handle -> (descs, NIXL reg list or None)
        self._regions: dict[MemKind, Descs] = {}         # everything registered, by kind
        self._peers: dict[str, _Peer] = {}
        self._preps: dict[int, _Prep] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._leaked: list[Any] = []                     # NIXL handles it would not free yet

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Any) -> RegHandle:
        self._check_open()
        descs = Descs.coerce(mem)
        self._check_kind(descs.kind)
        reg = None
        if len(descs):  # NIXL cannot register an empty list; kvt allows it
            try:
                reg = self._agent.register_memory(descs.array, descs.kind.value)
            except Exception as e:
                raise native.translate(e, f"registering {len(descs)} {descs.kind.value} regions",
                                       InvalidArgument) from e
        with self._lock:
            h = self._next_id()
            self._regs[h] = (descs, reg)
            self._rebuild_regions()
        return RegHandle(h)

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        with self._lock:
            rec = self._regs.get(handle)
            if rec is None:
                raise InvalidHandle(f"no registration with handle {handle!r} (already deregistered?)")
            if rec[1] is not None:
                try:
                    self._agent.deregister_memory(rec[1])
                except Exception as e:
                    raise native.translate(e, f"deregistering handle {handle}", InvalidArgument) from e
            del self._regs[handle]
            self._rebuild_regions()
            self._local_gen = next(self._gens)  # preps may point into it: re-check them before use

    def _rebuild_regions(self) -> None:
        by_kind: dict[MemKind, list[np.ndarray]] = {}
        for descs, _ in self._regs.values():
            by_kind.setdefault(descs.kind, []).append(descs.array)
        self._regions = {k: Descs(np.concatenate(v), k) for k, v in by_kind.items()}

    # -- peers ----------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        try:
            blob = self._agent.get_agent_metadata()
        except Exception as e:
            raise native.translate(e, "reading our NIXL metadata", TransferError) from e
        return pack(self.agent_name, blob, dict(self._regions))

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        md, regions = unpack(metadata)
        if md.name == self.agent_name:
            raise InvalidArgument(f"metadata is this agent's own ({md.name!r}); local transfers use prep(None, ...)")
        with self._lock:
            try:
                name = self._agent.add_remote_agent(md.nixl)
            except Exception as e:
                raise native.translate(e, f"loading the NIXL metadata of {md.name!r}", WireError) from e
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != md.name:
                if name not in self._peers:
                    self._agent.remove_remote_agent(name)
                raise WireError(f"metadata says agent {md.name!r} but its NIXL part belongs to {name!r}")
            self._peers[name] = _Peer(regions, next(self._gens))  # NIXL invalidated older preps
        return name

    def remove_remote(self, peer: str) -> None:
        self._check_open()
        with self._lock:
            if self._peers.pop(peer, None) is None:
                raise UnknownPeer(self._unknown(peer))
            for x in list(self._xfers.values()):
                if x.peer == peer and x.state is _PROC:
                    self._poll(x)
                    if x.state is _PROC:
                        x.state = XferState.err(PeerDisconnected(f"peer {peer!r} was removed"))
                        self._free_xfer(x, wait=False)
            for p in self._preps.values():
                if p.peer == peer:
                    self._free_prep(p)
            self._agent.remove_remote_agent(peer)  # returns a status; nothing to undo either way

    def _unknown(self, name: str) -> str:
        return (f"unknown peer {name!r}; load its metadata with add_remote first "
                f"(known: {sorted(self._peers) or 'none'})")

    # -- prep -----------------------------------------------------------------

    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        self._check_open()
        descs = Descs.coerce(descs)
        self._check_kind(descs.kind)
        if len(descs) > _MAX_ROWS:
            raise InvalidArgument(f"{len(descs)} descriptors in one list; NIXL takes at most {_MAX_ROWS}")
        if peer == self.agent_name:
            peer = None
        with self._lock:
            gen = self._check_prep(peer, descs)
            p = _Prep(peer, descs, self._native_prep(peer, descs), gen)
            h = self._next_id()
            self._preps[h] = p
        return PrepHandle(h)

    def _check_prep(self, peer: str | None, descs: Descs) -> int:
        """Check ``descs`` against the memory ``peer`` registered; its generation."""
        if peer is None:
            regions, gen, what = self._regions, self._local_gen, "local descriptors"
        else:
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeer(self._unknown(peer))
            regions, gen, what = p.regions, p.gen, f"descriptors of peer {peer!r}"
        mine = regions.get(descs.kind)
        descs.check_within(mine if mine is not None else Descs(np.zeros((0, 3), np.uint64), descs.kind), what)
        return gen

    def _native_prep(self, agent: str | None, descs: Descs) -> Any:
        if not len(descs):
            return None  # NIXL cannot prep an empty list; transfers on it move nothing
        try:
            return self._agent.prep_xfer_dlist(agent or native.INIT_AGENT, descs.array, descs.kind.value)
        except Exception as e:
            raise native.translate(e, f"prepping {len(descs)} descriptors for {agent or 'this agent'}",
                                   InvalidDescriptor, {"NIXL_ERR_NOT_FOUND": InvalidDescriptor}) from e

    def _fresh(self, p: _Prep, target: bool) -> Any:
        """The NIXL handle to use for ``p``: its own side, or (``target`` and
        local) its loopback side; re-prepped first if it went stale."""
        with self._lock:
            gen = self._check_prep(p.peer, p.descs)  # UnknownPeer if the peer was removed
            if p.gen != gen:
                self._free_prep(p)
                p.side, p.gen = self._native_prep(p.peer, p.descs), gen
            if target and p.peer is None and p.loop is None and len(p.descs):
                p.loop = self._native_prep(self.agent_name, p.descs)
            return p.loop if target and p.peer is None else p.side

    def _free_prep(self, p: _Prep) -> None:
        for h in (p.side, p.loop):
            if h is not None:
                try:
                    self._agent.release_dlist_handle(h)
                except Exception as e:  # nothing the caller can do; NIXL frees it at close
                    log.warning("NIXL would not release a prepped list: %s", native.status_name(e))
        p.side = p.loop = None
        p.gen = -1

    # -- transfers ------------------------------------------------------------

    def transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle,
                 remote_idx: Any, notif: bytes | None = None) -> XferHandle:
        if self._closed:
            self._check_open()
        if notif is not None or (op is not Op.READ and op is not Op.WRITE):
            op = self._check_op(op, notif)
            if notif is not None and not len(notif):
                raise InvalidArgument("NIXL cannot attach an empty notification to a transfer (it means "
                                      "'none'); send a non-empty message, or notify() separately")
        lp, rp = self._preps.get(local_prep), self._preps.get(remote_prep)
        if lp is None or rp is None:
            raise InvalidHandle(f"no prepped list with handle {local_prep if lp is None else remote_prep!r} (released?)")
        if lp.peer is not None:
            raise InvalidArgument("local_prep must come from prep(None, ...): it describes our own memory")
        peer = rp.peer
        lside = lp.side if lp.gen == self._local_gen else self._fresh(lp, False)
        if peer is None:
            rside = rp.loop if rp.gen == self._local_gen and rp.loop is not None else self._fresh(rp, True)
        else:
            known = self._peers.get(peer)
            rside = rp.side if known is not None and rp.gen == known.gen else self._fresh(rp, False)
        li = lp.all_rows() if local_idx is None else _rows(local_idx, lp, "local_idx")
        ri = rp.all_rows() if remote_idx is None else _rows(remote_idx, rp, "remote_idx")
        if not li.size or lside is None or rside is None:
            return self._empty(lp, li, rp, ri, notif)
        try:
            xh = self._agent.make_prepped_xfer(op, lside, li, rside, ri, notif or b"")
        except Exception as e:
            if native.status_name(e) == "NIXL_ERR_INVALID_PARAM":
                self._pair(lp.descs, li, rp.descs, ri)  # raises the precise InvalidArgument
            raise native.translate(e, f"creating a {op.value} of {li.size} descriptors", InvalidArgument) from e
        x = _Xfer(xh, peer, time.monotonic() + self.timeout)
        try:
            s = self._agent.transfer(xh)
            if s == "DONE":  # small or same-host (cma) copies finish within the post
                x.state = _DONE
            elif s == "ERR":
                self._poll(x)  # NIXL says why when asked
        except Exception as e:  # e.g. the peer is already gone
            x.state = XferState.err(native.translate(e, f"posting a {op.value} to {peer or 'this agent'}", TransferError))
        h = self._next_id()
        self._xfers[h] = x
        return XferHandle(h)

    def _empty(self, lp: _Prep, li: np.ndarray, rp: _Prep, ri: np.ndarray, notif: bytes | None) -> XferHandle:
        """A transfer of no rows (NIXL refuses those): DONE at once; its
        notification is still delivered."""
        self._pair(lp.descs, li, rp.descs, ri)  # equal (zero) counts, in range
        if notif is not None:
            self._send_notif(rp.peer or self.agent_name, notif)
        h = self._next_id()
        self._xfers[h] = _Xfer(None, rp.peer, 0.0, _DONE)
        return XferHandle(h)

    def check_state(self, handle: XferHandle) -> XferState:
        if self._closed:
            self._check_open()
        x = self._xfers.get(handle)
        if x is None:
            raise InvalidHandle(f"no transfer with handle {handle!r} (released?)")
        if x.state is _PROC:
            self._poll(x)
        return x.state

    def _poll(self, x: _Xfer) -> None:
        """Ask NIXL once; enforce the deadline NIXL does not have."""
        try:
            s = self._agent.check_xfer_state(x.handle)
        except Exception as e:
            x.state = XferState.err(native.translate(e, f"transfer with {x.peer or 'this agent'}", TransferError))
            return
        if s == "DONE":
            x.state = _DONE
        elif s == "ERR":
            x.state = XferState.err(TransferError(f"NIXL reported ERR for a transfer with {x.peer or 'this agent'}"))
        elif time.monotonic() > x.deadline:
            x.state = XferState.err(TransferTimeout(
                f"transfer with {x.peer or 'this agent'} still in progress after {self.timeout:g}s "
                "(option 'timeout'); is the peer alive and progressing?"))

    def release(self, handle: XferHandle | PrepHandle) -> None:
        if self._closed:
            self._check_open()
        x = self._xfers.pop(handle, None)
        if x is not None:
            if x.handle is not None:
                self._free_xfer(x, wait=True)
            return
        with self._lock:
            p = self._preps.pop(handle, None)
            if p is None:
                raise InvalidHandle(f"no transfer or prep with handle {handle!r} (released twice?)")
            self._free_prep(p)

    def _free_xfer(self, x: _Xfer, wait: bool) -> None:
        """Release NIXL's handle.  NIXL cancels what it can; one it cannot
        free yet is waited for (``wait``, bounded by ``timeout``), then kept
        to retry at ``close``."""
        end = time.monotonic() + (self.timeout if wait else 0.0)
        while True:
            try:
                self._agent.release_xfer_handle(x.handle)
                break
            except Exception:
                if time.monotonic() >= end:
                    self._leaked.append(x.handle)
                    break
            try:
                self._agent.check_xfer_state(x.handle)  # lets NIXL progress it
            except Exception:
                pass
            time.sleep(0.001)
        x.handle = None

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._check_notif(msg)
        if peer not in self._peers:
            raise UnknownPeer(self._unknown(peer))
        self._send_notif(peer, msg)

    def _send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, bytes(msg))
        except Exception as e:
            raise native.translate(e, f"notifying {peer!r}", TransferError, {"NIXL_ERR_NOT_FOUND": UnknownPeer}) from e

    def get_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        try:
            return self._agent.get_new_notifs()
        except Exception as e:
            raise native.translate(e, "fetching notifications", TransferError) from e

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Release every handle, registration and peer, then the NIXL agent.
        Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for x in self._xfers.values():
                if x.handle is not None:
                    self._free_xfer(x, wait=False)
            for p in self._preps.values():
                self._free_prep(p)
            for descs, reg in self._regs.values():
                if reg is not None:
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception as e:
                        log.warning("NIXL would not deregister memory at close: %s", native.status_name(e))
            for peer in self._peers:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass
            for h in self._leaked:  # last try; the agent's destructor gets the rest
                try:
                    self._agent.release_xfer_handle(h)
                except Exception:
                    pass
            self._xfers.clear()
            self._preps.clear()
            self._regs.clear()
            self._peers.clear()
            self._leaked.clear()
            self._regions = {}
            self._agent = None  # the last reference: NIXL's destructor stops its threads


def _rows(idx: Any, prep: _Prep, what: str) -> np.ndarray:
    """Row indices as the int32 array NIXL takes.  An int32 array passes
    untouched (NIXL checks its range); anything else is validated first,
    since NIXL would silently wrap wider integers."""
    if type(idx) is np.ndarray and idx.dtype is _I32 and idx.ndim == 1:
        return idx
    return as_index(idx, len(prep.descs), what).astype(np.int32)
