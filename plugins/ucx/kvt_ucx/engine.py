"""The service thread: it owns the UCX worker and makes every UCX call.

User threads hand it work through a queue (``submit``) and read results from
records it updates, so ``transfer`` never blocks on the network and no two
threads race inside UCX.  One loop drives everything::

    progress the worker -> run queued work -> take control messages
        -> advance transfers (ours) and services (for peers) -> sweep deadlines
        -> nothing in flight?  arm the worker and sleep on its event fd

As initiator it runs the two halves of a one-sided verb over tag messages:

* READ:  post receives for every message (straight into our memory, or into
  staging buffers), then send the target a ``Request``; the target sends the
  data; we scatter staged messages; ``notif`` goes to the target afterwards.
* WRITE: send the ``Request``; the target posts its receives and answers
  ``ready``; we send the data; the target scatters, delivers ``notif`` and
  answers ``done``.

As target it serves requests only inside memory it registered; anything else
is answered with an error and nothing is touched.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import select
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np
from kvt.backend import RegionTable
from kvt.errors import (ClosedError, ConfigError, KvtTimeoutError, PeerDisconnected, RemoteRejected, TransferError,
                        TransferTimeout)
from kvt.procs import host_id, start_time
from kvt.types import Descs, MemKind, Op, XferState

from . import native
from .plan import Plan, gather, scatter
from .protocol import CTRL_TAG, Ident, Notif, Reply, Request, data_tag, decode_ctrl, encode, rows_of

__all__ = ["Engine", "Xfer", "EngineOptions"]

log = logging.getLogger("kvt.ucx")

_SWEEP = 0.05     # seconds between deadline and liveness sweeps
_SPIN = 0.002     # keep polling this long after the last event while data is in flight
_IDLE_WAIT = 0.1  # longest sleep on the worker's event fd


@dataclass(frozen=True)
class EngineOptions:
    timeout: float
    zcopy_min: int            # runs at least this long are sent in place
    stage_max: int            # bytes per staged message
    pool_bytes: int           # staging buffers kept for reuse
    error_handling: str       # "auto" (cross-host peers only) | "peer" | "none"
    ucx: dict[str, str]       # UCX configuration (names without the UCX_ prefix)


class _Requests:
    """The UCX requests of one record; completions are taken in posting order."""

    __slots__ = ("items", "done")

    def __init__(self):
        self.items: list = []
        self.done = 0

    def add(self, req, j: int) -> None:
        self.items.append((req, j))

    @property
    def pending(self) -> bool:
        return self.done < len(self.items)

    def advance(self) -> list[int]:
        """Messages newly completed; raises the ucxx error of a failed one."""
        out = []
        while self.done < len(self.items):
            req, j = self.items[self.done]
            if not req.completed:
                break
            req.check_error()
            self.items[self.done] = None
            self.done += 1
            out.append(j)
        return out


class _Pool:
    """Reusable staging buffers (fresh pages cost page faults); service thread only."""

    def __init__(self, cap: int):
        self._free: dict[int, list[np.ndarray]] = {}
        self._held, self._cap = 0, cap

    def get(self, n: int) -> np.ndarray:
        size = max(1 << 20, 1 << max(n - 1, 0).bit_length())
        free = self._free.get(size)
        if free:
            self._held -= size
            return free.pop()[:n]
        return np.empty(size, np.uint8)[:n]

    def put(self, view: np.ndarray) -> None:
        buf = view.base if view.base is not None else view
        if self._held + buf.nbytes <= self._cap:
            self._free.setdefault(buf.nbytes, []).append(buf)
            self._held += buf.nbytes


@dataclass(eq=False)
class Xfer:
    """A transfer we initiated.  ``state`` is written by the service thread only."""

    op: Op
    peer: Ident
    kind: MemKind            # of the remote rows (the target checks them against this kind)
    local_kind: MemKind
    plan: Plan
    notif: bytes | None
    deadline: float
    state: XferState = XferState.PROC
    seq: int = -1
    got_done: bool = False
    reqs: _Requests = field(default_factory=_Requests)
    stages: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(eq=False)
class _Service:
    """A request we serve for a peer."""

    client: Ident
    req: Request
    rows: np.ndarray
    bounds: np.ndarray
    staged: np.ndarray
    deadline: float
    reqs: _Requests = field(default_factory=_Requests)
    stages: dict[int, np.ndarray] = field(default_factory=dict)


class Engine:
    """One UCX context and worker, and the thread that drives them.

    ``regions`` is the backend's ``RegionTable`` (read here without a lock:
    it is replaced wholesale); ``deliver(sender, msg)`` receives notifications.
    """

    def __init__(self, name: str, opts: EngineOptions, regions: RegionTable,
                 deliver: Callable[[str, bytes], None]):
        self.api = api = native.load()
        self.opts, self._regions, self._deliver = opts, regions, deliver
        try:
            self.ctx = api.UCXContext(config_dict=dict(opts.ucx), feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
            self.worker = api.UCXWorker(self.ctx)
            self.worker.init_blocking_progress_mode()
            address = bytes(self.worker.address)
        except Exception as e:  # ucxx raises its own errors (InvalidParam, NoDevice...) for bad settings
            raise ConfigError(f"UCX refused to start with settings {dict(opts.ucx)} (option 'ucx') and the "
                              f"UCX_* environment: {type(e).__name__}: {e}") from e
        pid = os.getpid()
        self.ident = Ident(name=name, address=address, uid=secrets.randbelow((1 << 31) - 1) + 1,
                           host=host_id(), pid=pid, start=start_time(pid))
        self.cuda = bool(self.ctx.cuda_support) and native.cuda_devices() > 0
        self._ctrl_tag = api.UCXXTag(CTRL_TAG)
        self._seq = 0
        self._pool = _Pool(opts.pool_bytes)
        self._eps: dict[bytes, Any] = {}                 # worker address -> endpoint
        self._xfers: dict[int, Xfer] = {}                # seq -> our transfer in flight
        self._services: dict[tuple[int, int], _Service] = {}  # (client uid, seq) -> service
        self._clients: dict[int, Ident] = {}             # uid -> identity, to catch uid clashes
        self._inbox: collections.deque = collections.deque()  # control receives, in arrival order
        self._sends: list = []                           # control sends in flight: (expiry, request, bytes)
        self._quarantine: list = []                      # (expiry, buffers) UCX may still touch
        self._queue: collections.deque = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._stop = False
        self.broken: TransferError | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvt-ucx-{name}", daemon=True)
        self._thread.start()

    # -- called from user threads -------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the service thread, soon."""
        if self._stop:
            raise ClosedError("the ucx backend's service thread has stopped")
        self._queue.append(fn)
        os.eventfd_write(self._wake, 1)

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on the service thread and wait for its result."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

        self.submit(run)
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise KvtTimeoutError(f"the ucx service thread did not answer within {timeout:g}s") from None

    def post(self, x: Xfer) -> None:
        self.submit(lambda: self._start(x))

    def fail_peer(self, name: str, cause: TransferError) -> None:
        """End every transfer to ``name`` with ``cause``."""
        self.submit(lambda: [self._fail(x, cause) for x in list(self._xfers.values()) if x.peer.name == name])

    def cancel(self, x: Xfer) -> None:
        self._fail(x, TransferError("released before completion"))

    def send_notif(self, peer: Ident, msg: bytes) -> None:
        def send():
            try:
                self._send_ctrl(peer, Notif(src=self.ident.name, msg=msg))
            except TransferError as e:  # fire and forget, like the data path's notifications
                log.warning("notification to %r not sent: %s", peer.name, e)

        self.submit(send)

    def close(self, timeout: float) -> None:
        """Stop the thread, end what is in flight, free UCX.  Idempotent."""
        if self._stop:
            return
        self._queue.append(self._shutdown)
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout)
        self._stop = True
        if self._thread.is_alive():
            log.error("ucx service thread did not stop within %.1fs; leaking its UCX worker", timeout)
            return
        self._epoll.close()
        os.close(self._wake)
        # endpoints and requests go before the worker, the worker before the context
        self._eps.clear()
        self._inbox.clear()
        self._sends.clear()
        del self.worker
        del self.ctx
        self._quarantine.clear()

    # -- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        last_event = next_sweep = 0.0
        try:
            while not self._stop:
                busy = False
                while self.worker.progress_once():
                    busy = True
                while self._queue:
                    self._run_queued(self._queue.popleft())
                    busy = True
                busy |= self._take_ctrl()
                busy |= self._advance()
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP
                if busy:
                    last_event = now
                    continue
                if self._moving() and now - last_event < _SPIN:
                    continue  # data in flight: poll, do not pay a wake-up per step
                if not self.worker.arm():
                    continue  # events arrived meanwhile
                wait = min(_IDLE_WAIT, max(next_sweep - now, 0.0)) if self._xfers or self._services else _IDLE_WAIT
                for fd, _ in self._epoll.poll(wait):
                    if fd == self._wake:
                        try:
                            os.eventfd_read(self._wake)
                        except BlockingIOError:
                            pass
        except Exception as e:  # a bug: fail everything in flight rather than hang it
            log.exception("ucx service thread crashed")
            self.broken = native.to_kvt(e, "ucx service thread crashed")
            for x in list(self._xfers.values()):
                self._fail(x, self.broken)
            self._stop = True

    @staticmethod
    def _run_queued(fn) -> None:
        try:
            fn()
        except Exception:  # one bad command must not take the loop (and every transfer) down
            log.exception("ucx service thread: queued work failed")

    def _shutdown(self) -> None:
        for x in list(self._xfers.values()):
            self._fail(x, TransferError("backend closed"))
        for key in list(self._services):
            self._drop_service(key)
        self._stop = True

    def _moving(self) -> bool:
        return any(x.reqs.pending for x in self._xfers.values()) or any(
            s.reqs.pending for s in self._services.values())

    # -- endpoints and control messages --------------------------------------------

    def _endpoint(self, peer: Ident):
        ep = self._eps.get(peer.address)
        if ep is None:
            mode = self.opts.error_handling
            checked = mode == "peer" or (mode == "auto" and peer.host != self.ident.host)
            try:
                addr = self.api.UCXAddress.create_from_buffer(peer.address)
                ep = self.worker.create_endpoint_from_worker_address(addr, checked)
            except Exception as e:
                raise PeerDisconnected(f"cannot reach peer {peer.name!r}: {type(e).__name__}: {e}") from e
            self._eps[peer.address] = ep
        return ep

    def _send_ctrl(self, peer: Ident, msg) -> None:
        """Post a control message; ``TransferError`` if the peer cannot be reached."""
        data = encode(msg)
        try:
            req = self._endpoint(peer).tag_send(native.Buffer(self.api, _addr_of(data), len(data)), self._ctrl_tag)
        except TransferError:
            raise
        except Exception as e:
            raise native.to_kvt(e, f"sending to {peer.name!r}") from e
        self._sends.append((time.monotonic() + self.opts.timeout, req, data))

    def _take_ctrl(self) -> bool:
        got = False
        while True:
            probe = self.worker.tag_probe(self._ctrl_tag, remove=True)
            if not probe.matched:
                break
            buf = np.empty(probe.length, np.uint8)
            self._inbox.append((self.worker.tag_recv_with_handle(native.Buffer(self.api, buf.ctypes.data, buf.nbytes),
                                                                 probe), buf))
            got = True
        while self._inbox and self._inbox[0][0].completed:
            req, buf = self._inbox.popleft()
            got = True
            try:
                req.check_error()
                msg = decode_ctrl(buf)
            except (msgspec.DecodeError, ValueError) as e:
                log.warning("dropped a malformed control message (%d bytes): %s", buf.nbytes, e)
                continue
            except Exception as e:  # a receive that failed in UCX
                log.warning("control message lost: %s", e)
                continue
            if isinstance(msg, Request):
                self._serve(msg)
            elif isinstance(msg, Reply):
                self._on_reply(msg)
            else:
                self._deliver(msg.src, msg.msg)
        return got

    # -- initiator side ---------------------------------------------------------------

    def _start(self, x: Xfer) -> None:
        if not x.state.pending:
            return  # released or failed before we got to it
        if self.broken:
            x.state = XferState.err(self.broken)
            return
        p = x.plan
        x.seq = self._seq
        self._seq += max(p.messages, 1)
        self._xfers[x.seq] = x
        try:
            if x.op is Op.READ:
                for j, buf in self._buffers(x.stages, p.local, p.bounds, p.staged, x.local_kind):
                    x.reqs.add(self.worker.tag_recv(buf, self._tag(self.ident.uid, x.seq + j)), j)
            self._send_ctrl(x.peer, Request(
                src=self.ident, seq=x.seq, op=x.op.value, kind=x.kind.value, ranges=p.remote.tobytes(),
                bounds=p.bounds.tobytes(), staged=p.staged.astype(np.uint8).tobytes(),
                notif=x.notif if x.op is Op.WRITE else None))
        except TransferError as e:
            self._fail(x, e)
        except Exception as e:
            self._fail(x, native.to_kvt(e, f"posting {x.op.value} to {x.peer.name!r}"))

    def _on_reply(self, r: Reply) -> None:
        x = self._xfers.get(r.seq)
        if x is None or r.src != x.peer.name:
            return  # a late answer for a transfer that already ended (or not from its peer)
        if r.status == "error":
            cls = RemoteRejected if r.code == "out_of_region" else TransferError
            self._fail(x, cls(f"peer {x.peer.name!r} refused the {x.op.value}: {r.error}"))
        elif r.status == "ready" and x.op is Op.WRITE and not x.reqs.items:
            try:
                ep = self._endpoint(x.peer)
                p = x.plan
                for j, buf in self._buffers(x.stages, p.local, p.bounds, p.staged, x.local_kind, fill=True):
                    x.reqs.add(ep.tag_send(buf, self._tag(self.ident.uid, x.seq + j)), j)
            except Exception as e:
                self._fail(x, e if isinstance(e, TransferError) else native.to_kvt(e, "sending WRITE data"))
        elif r.status == "done":
            x.got_done = True

    def _advance(self) -> bool:
        moved = False
        for x in list(self._xfers.values()):
            try:
                done = x.reqs.advance()
            except Exception as e:
                self._fail(x, native.to_kvt(e, f"{x.op.value} with {x.peer.name!r}"))
                continue
            for j in done:
                moved = True
                stage = x.stages.pop(j, None)
                if stage is not None:
                    if x.op is Op.READ:
                        p = x.plan
                        scatter(p.local[p.bounds[j]:p.bounds[j + 1]], stage)
                    self._pool.put(stage)
            finished = not x.reqs.pending and (x.got_done if x.op is Op.WRITE else x.reqs.done == x.plan.messages)
            if finished:
                moved = True
                if x.op is Op.READ and x.notif is not None:
                    try:
                        self._send_ctrl(x.peer, Notif(src=self.ident.name, msg=x.notif))
                    except TransferError as e:  # the data is here, but the target cannot be told
                        self._fail(x, e)
                        continue
                del self._xfers[x.seq]
                x.state = XferState.DONE
        for key, s in list(self._services.items()):
            try:
                done = s.reqs.advance()
            except Exception as e:
                log.info("serving %s for %r failed: %s", s.req.op, s.client.name, e)
                self._drop_service(key)
                continue
            for j in done:
                moved = True
                stage = s.stages.pop(j, None)
                if stage is not None:
                    if s.req.op == "WRITE":
                        scatter(s.rows[s.bounds[j]:s.bounds[j + 1]], stage)
                    self._pool.put(stage)
            if s.reqs.done == len(s.staged):
                moved = True
                del self._services[key]
                if s.req.op == "WRITE":
                    if s.req.notif is not None:
                        self._deliver(s.client.name, s.req.notif)
                    self._reply(s.client, s.req.seq, "done")
        return moved

    def _fail(self, x: Xfer, cause: TransferError) -> None:
        if not x.state.pending:
            return
        self._xfers.pop(x.seq, None)
        self._retire(x)
        x.state = XferState.err(cause)

    def _retire(self, rec: "Xfer | _Service") -> None:
        """Drop a failed record's requests (ucxx cancels a request when its
        object goes) but keep its staging buffers out of the pool for a
        while: a request UCX had already matched may still touch them."""
        self._quarantine.append((time.monotonic() + self.opts.timeout, list(rec.stages.values())))
        rec.reqs, rec.stages = _Requests(), {}

    # -- target side --------------------------------------------------------------------

    def _serve(self, r: Request) -> None:
        c = r.src
        known = self._clients.get(c.uid)
        if known is not None and known.name != c.name and self._alive(known):
            self._reply(c, r.seq, "error", f"tag id {c.uid} is already used by live agent {known.name!r}; "
                        "recreate one of the two agents", "busy")
            return
        self._clients[c.uid] = c
        try:
            kind = MemKind(r.kind)
            rows = rows_of(r.ranges)
            bounds = rows_of(r.bounds, 1, np.int64).ravel()
            staged = np.frombuffer(r.staged, np.uint8).astype(bool)
            single = np.diff(bounds) == 1
            if (len(bounds) != len(staged) + 1 or (len(bounds) and (bounds[0] != 0 or bounds[-1] != len(rows)))
                    or (np.diff(bounds) < 1).any() or not single[~staged].all()
                    or (kind is not MemKind.DRAM and staged.any()) or r.op not in ("READ", "WRITE")):
                raise ValueError("inconsistent message plan")
        except ValueError as e:
            self._reply(c, r.seq, "error", f"malformed request: {e}", "bad_request")
            return
        where = Descs(rows, kind).locate(self._regions.of(kind))
        bad = np.flatnonzero(where < 0)
        if bad.size:
            a, n = (int(v) for v in rows[bad[0], :2])
            self._reply(c, r.seq, "error", f"{bad.size} of {len(rows)} ranges are outside memory this agent "
                        f"registered ({kind.value}); first: address {a:#x}, length {n}", "out_of_region")
            return
        s = _Service(client=c, req=r, rows=rows[:, :2], bounds=bounds, staged=staged,
                     deadline=time.monotonic() + self.opts.timeout)
        key = (c.uid, r.seq)
        self._services[key] = s
        try:
            ep = self._endpoint(c)
            write = r.op == "WRITE"
            for j, buf in self._buffers(s.stages, s.rows, bounds, staged, kind, fill=not write):
                tag = self._tag(c.uid, r.seq + j)
                s.reqs.add(self.worker.tag_recv(buf, tag) if write else ep.tag_send(buf, tag), j)
            if write:
                self._reply(c, r.seq, "ready")
        except Exception as e:
            log.info("cannot serve %s for %r: %s", r.op, c.name, e)
            self._drop_service(key)

    def _reply(self, client: Ident, seq: int, status: str, error: str = "", code: str = "") -> None:
        try:
            self._send_ctrl(client, Reply(seq=seq, status=status, src=self.ident.name, error=error, code=code))
        except TransferError as e:  # the initiator is gone: its deadline or liveness check ends it
            log.info("cannot answer %r: %s", client.name, e)

    def _drop_service(self, key) -> None:
        s = self._services.pop(key, None)
        if s is not None:
            self._retire(s)

    # -- shared helpers -------------------------------------------------------------------

    def _tag(self, uid: int, seq: int):
        return self.api.UCXXTag(data_tag(uid, seq))

    def _buffers(self, stages: dict, rows: np.ndarray, bounds: np.ndarray, staged: np.ndarray, kind: MemKind,
                 fill: bool = False):
        """``(j, ucxx buffer)`` per message: a staging buffer (gathered from
        ``rows`` first if ``fill``) or the run's own memory."""
        ends = np.concatenate((np.zeros(1, np.uint64), np.cumsum(rows[:, 1], dtype=np.uint64)))
        cuda = kind is MemKind.VRAM
        for j, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            if staged[j]:
                stage = stages[j] = self._pool.get(int(ends[hi] - ends[lo]))
                if fill:
                    gather(rows[lo:hi], stage)
                yield j, native.Buffer(self.api, stage.ctypes.data, stage.nbytes)
            else:
                yield j, native.Buffer(self.api, int(rows[lo, 0]), int(rows[lo, 1]), cuda)

    def _alive(self, peer: Ident) -> bool:
        """False once we know ``peer`` is gone: its pid on this host, or a
        checked endpoint that UCX reported dead."""
        if peer.host == self.ident.host:
            return peer.pid == self.ident.pid or start_time(peer.pid) == peer.start
        ep = self._eps.get(peer.address)
        return ep is None or ep.alive

    def _sweep(self, now: float) -> None:
        # a send to a dead peer never completes; give up on it after the timeout
        self._sends = [(t, r, d) for t, r, d in self._sends if not r.completed and t > now]
        self._quarantine = [(t, bufs) for t, bufs in self._quarantine if t > now]
        verdict: dict[bytes, bool] = {}

        def alive(p: Ident) -> bool:
            if p.address not in verdict:
                verdict[p.address] = self._alive(p)
            return verdict[p.address]

        for x in list(self._xfers.values()):
            if now > x.deadline:
                self._fail(x, TransferTimeout(f"{x.op.value} with {x.peer.name!r} did not complete within "
                                              f"{self.opts.timeout:g}s"))
            elif not alive(x.peer):
                self._fail(x, PeerDisconnected(f"peer {x.peer.name!r} (pid {x.peer.pid}) died during "
                                               f"{x.op.value}"))
        for key, s in list(self._services.items()):
            if now > s.deadline or not alive(s.client):
                self._drop_service(key)
        for addr in [a for a, ok in verdict.items() if not ok]:
            self._eps.pop(addr, None)  # a dead peer's endpoint; a restarted peer has a new address
        if not (self._xfers or self._services):
            self.worker.progress()  # ucxx's own housekeeping (scheduled cancellations)


def _addr_of(data: bytes) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data
