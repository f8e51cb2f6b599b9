"""``ucx``: kvt's one-sided verbs over raw UCX, through ucxx tag messages.

ucxx has no RMA, so READ and WRITE are two-sided underneath: the target's
service thread answers requests, only inside memory it registered (see
:mod:`kvt_ucx.engine`).  Small blocks travel packed into staging messages,
large ones straight between the two processes' memory (:mod:`kvt_ucx.plan`).

Speed and failure detection: UCX's peer error-handling mode disables its
shared-memory transports, so endpoints to peers on this host run without it
(shared memory and cross-memory attach at full speed) and a dead same-host
peer is detected by its pid (checked every 50 ms while a transfer is in
flight).  Endpoints to other hosts use UCX's error handling.  Every transfer
also has a deadline: ``timeout`` seconds.  See docs/backends/ucx.md.

Options: ``timeout`` (s, default 30), ``zcopy_min`` (bytes; runs this long go
in place, default 256 KiB), ``stage_max`` (bytes per staged message, default
4 MiB), ``pool_bytes`` (staging buffers kept, default 256 MiB),
``error_handling`` (``auto`` | ``peer`` | ``none``), ``ucx`` (a table of UCX
settings without the ``UCX_`` prefix, e.g. ``{TLS = "tcp,self"}``).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from kvt.backend import Backend, HandleTable, Inbox, RegionTable, take_handle, unknown_peer
from kvt.errors import (ClosedError, ConfigError, InvalidArgument, KvtError, PeerDisconnected, TransferError,
                        WireError)
from kvt.types import (Availability, Capabilities, Descs, MemKind, Op, PrepHandle, RegHandle, XferHandle,
                       XferState, as_index)
from kvt.wire import decode, encode

from . import native
from .engine import Engine, EngineOptions, Xfer
from .plan import make_plan
from .protocol import UcxMetadata, rows_of

__all__ = ["UcxBackend"]

_MODES = ("auto", "peer", "none")


@dataclass(frozen=True)
class _Prep:
    peer: str | None
    descs: Descs
    region: np.ndarray  # registration index of each row (from locate)


@dataclass
class _Peer:
    md: UcxMetadata
    regions: dict[MemKind, Descs]


def _caps(cuda: bool) -> Capabilities:
    kinds = {MemKind.DRAM, MemKind.VRAM} if cuda else {MemKind.DRAM}
    return Capabilities(mem_kinds=frozenset(kinds), ops=frozenset(Op), notifications=True, local=True,
                        remote=True, cross_host=True, max_notif_bytes=1 << 20)


def _size(options: Mapping[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ucx backend option {key!r} must be a positive integer (bytes), got {value!r}")
    return value


class UcxBackend(Backend):
    """kvt over UCX (ucxx).  One UCX context, worker and service thread per instance."""

    # VRAM only where a CUDA driver reports a device; each instance narrows
    # this further to what its UCX context supports.
    capabilities = _caps(native.cuda_devices() > 0)

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, f"needs Linux; this is {sys.platform}")
        reason = native.load_error()
        return Availability(not reason, reason)

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None):
        super().__init__(agent_name, options)
        o = self.options
        mode = o.get("error_handling", "auto")
        if mode not in _MODES:
            raise ConfigError(f"ucx backend option 'error_handling' must be one of {_MODES}, got {mode!r}")
        ucx = o.get("ucx", {})
        if not isinstance(ucx, Mapping):
            raise ConfigError(f"ucx backend option 'ucx' must be a table of UCX settings, got {ucx!r}")
        opts = EngineOptions(timeout=self.timeout, zcopy_min=_size(o, "zcopy_min", 256 << 10),
                             stage_max=_size(o, "stage_max", 4 << 20), pool_bytes=_size(o, "pool_bytes", 256 << 20),
                             error_handling=mode, ucx={str(k): str(v) for k, v in ucx.items()})
        self._lock = threading.RLock()
        self._regions = RegionTable()
        self._preps = HandleTable("prepped descriptor list")
        self._xfers = HandleTable("transfer")
        self._peers: dict[str, _Peer] = {}
        self._inbox = Inbox()
        self._engine = Engine(agent_name, opts, self._regions, self._inbox.deliver)
        if not self._engine.cuda and MemKind.VRAM in self.capabilities.mem_kinds:
            self.capabilities = _caps(False)  # this context has no CUDA transport

    # -- memory ---------------------------------------------------------------

    def register(self, mem: Any) -> RegHandle:
        self._check_open()
        descs = Descs.coerce(mem)
        self._check_kind(descs.kind)
        h = self._next_id()
        self._regions.add(h, descs)
        return RegHandle(h)

    def deregister(self, handle: RegHandle) -> None:
        self._check_open()
        self._regions.remove(handle)

    # -- peers ----------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        return encode(UcxMetadata(ident=self._engine.ident,
                                  regions={k.value: d.array.tobytes() for k, d in self._regions.by_kind().items()}))

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        md = decode(metadata, UcxMetadata)
        name = md.ident.name
        if name == self.agent_name:
            raise InvalidArgument(f"metadata is this agent's own ({name!r}); local transfers use prep(None, ...)")
        try:
            regions = {MemKind(k): Descs(rows_of(v), k) for k, v in md.regions.items()}
        except (ValueError, KvtError) as e:
            raise WireError(f"bad region table in metadata of {name!r}: {e}") from e
        with self._lock:
            old = self._peers.get(name)
            self._peers[name] = _Peer(md, regions)
        if old is not None and old.md.ident != md.ident:  # restarted: what was in flight went to the old one
            self._engine.fail_peer(name, PeerDisconnected(f"peer {name!r} restarted (new process); "
                                                          "this transfer was meant for the old one"))
        return name

    def remove_remote(self, peer: str) -> None:
        self._check_open()
        with self._lock:
            if self._peers.pop(peer, None) is None:
                raise unknown_peer(peer, self._peers)
        self._engine.fail_peer(peer, PeerDisconnected(f"peer {peer!r} was removed"))

    def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            raise unknown_peer(name, self._peers)
        return p

    # -- transfers ------------------------------------------------------------

    def prep(self, peer: str | None, descs: Descs) -> PrepHandle:
        self._check_open()
        descs = Descs.coerce(descs)
        self._check_kind(descs.kind)
        if peer is None:
            regions, what = self._regions.of(descs.kind), "local descriptors"
        else:
            regions, what = self._peer(peer).regions.get(descs.kind), f"descriptors of peer {peer!r}"
        region = descs.check_within(regions if regions is not None else Descs.empty(descs.kind), what)
        h = self._next_id()
        self._preps[h] = _Prep(peer, descs, region)
        return PrepHandle(h)

    def transfer(self, op: Op, local_prep: PrepHandle, local_idx: Any, remote_prep: PrepHandle,
                 remote_idx: Any, notif: bytes | None = None) -> XferHandle:
        self._check_open()
        op = self._check_op(op, notif)
        lp, rp = self._preps[local_prep], self._preps[remote_prep]
        if lp.peer is not None:
            raise InvalidArgument("local_prep must come from prep(None, ...): it describes our own memory")
        ident = self._engine.ident if rp.peer is None else self._peer(rp.peer).md.ident
        lrows, rrows = self._pair(lp.descs, local_idx, rp.descs, remote_idx)
        rregion = rp.region[as_index(remote_idx, len(rp.descs), "remote_idx")]
        o = self._engine.opts
        # device memory is never staged through numpy: every run goes in place
        on_device = lp.descs.kind is not MemKind.DRAM or rp.descs.kind is not MemKind.DRAM
        plan = make_plan(lrows, rrows, rregion, sender_is_local=op is Op.WRITE, zcopy_min=o.zcopy_min,
                         stage_max=o.stage_max, in_place_only=on_device)
        x = Xfer(op=op, peer=ident, kind=rp.descs.kind, local_kind=lp.descs.kind, plan=plan,
                 notif=None if notif is None else bytes(notif), deadline=time.monotonic() + self.timeout)
        h = self._next_id()
        self._xfers[h] = x
        self._engine.post(x)
        return XferHandle(h)

    def check_state(self, handle: XferHandle) -> XferState:
        self._check_open()
        return self._xfers[handle].state

    def release(self, handle: XferHandle | PrepHandle) -> None:
        self._check_open()
        x = take_handle(self._preps, self._xfers, handle)
        if x is not None and x.state.pending:  # cancel on the service thread, which owns its requests
            try:
                self._engine.call(lambda: self._engine.cancel(x), self.timeout)
            except ClosedError:  # the thread is gone, and with it every request
                x.state = XferState.err(TransferError("released before completion"))

    # -- notifications --------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._check_notif(msg)
        self._engine.send_notif(self._peer(peer).md.ident, bytes(msg))

    def get_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        return self._inbox.take()

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.close(self.timeout + 5)
        for x in self._xfers.values():
            if x.state.pending:
                x.state = XferState.err(TransferError("backend closed"))
        self._xfers.clear()
        self._preps.clear()
        self._peers.clear()
        self._regions.clear()
