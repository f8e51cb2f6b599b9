"""Worker side of the connector: one per TP rank of an engine.

Per engine step the engine calls, in order::

    worker.start_load_kv(meta)      # non-blocking: handshakes and reads start
    ... forward pass ...
    worker.wait_for_save()          # host staging: device -> host copies
    sending, recving = worker.get_finished()
    bad = worker.get_block_ids_with_load_errors()

Decode side: each ``reqs_to_recv`` entry needs the prefill engine's worker
metadata; one handshake per remote engine runs on a background thread (it
only talks to the side channel and checks compatibility; the backend is
touched on the engine's thread).  Reads start as soon as it completes.  One
connection is kept per engine id, with the endpoints it was made through: a
request naming other endpoints handshakes with those (and its connection
replaces the old one), it never reads through the old connection.  A
request whose handshake or read fails is still returned by ``get_finished``
— with its blocks in ``get_block_ids_with_load_errors`` — so the engine can
recompute or fail it; it is never reported loaded when it is not.

With integrity checks on (``KVT_INTEGRITY=1`` on both engines) a request's
landed blocks are proven against the prefill rank's digests of its own
(``kvt.integrity``) on a thread of the worker's, never on the engine's step;
the request is reported loaded only once they agree, and failed (its blocks
in ``get_block_ids_with_load_errors``) when they differ or cannot be had.

Prefill side: ``reqs_to_send`` requests are held until every decode rank
that reads this rank's blocks has sent its ``ReadNotif`` (attached to its
read, so it arrives after the data left; with integrity checks on, sent
once the blocks are proven, so they stay put while they are digested), or
until ``expires_at``; then they are returned as done sending and the engine
frees their blocks.  A
notification counts only when it comes from the decode rank it names (see
``ReadNotif``).

Nothing but ``InvalidArgument`` / ``ClosedError`` for a misuse leaves
``start_load_kv`` or ``get_finished``: a failure inside the connector fails
the requests it affects (returned with their blocks in
``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Mapping

import numpy as np

from .. import integrity
from ..agent import Agent, Transfer, fetch_info
from ..errors import (ClosedError, ConfigError, HandshakeTimeout, IncompatiblePeer, InvalidArgument, KvtError,
                      PeerDisconnected, TransferTimeout, WireError)
from ..types import Op, PrepHandle
from ..wire import AgentInfo, BlockLayout
from .compat import WorkerCard, check_peer
from .config import ConnectorConfig
from .metadata import ConnectorMetadata, ReadNotif, RecvRequest, RemoteSource
from .staging import CopyBlocks, HostStaging
from .tp import Slice, part_layout, plan_reads, readers_per_rank, remote_ranks

__all__ = ["ConnectorWorker"]

log = logging.getLogger(__name__)
_LAYOUT = "kv"
_SLACK = 5.0  # seconds past transfer_timeout before we stop waiting on a backend
# notifications for requests we do not hold (yet): legitimately a few at a time (a read that
# beat its hold), so a peer naming made-up requests or readers is bounded here, oldest dropped
MAX_EARLY, MAX_EARLY_READERS = 1024, 64
# requests released recently: a notification for one of them (a repeat, a reader that came after
# expiry) is dropped, not kept as "early" for a later hold reusing the id; oldest dropped past the cap
MAX_RELEASED, RELEASED_TTL = 1 << 16, 60.0
QUIET = 10.0  # seconds between the warnings a peer's bad notifications can cause
# handshake threads per worker: they mostly wait on the network, so a few peers that never answer
# (params naming dead or silent endpoints) must not hold up the handshakes queued behind them
HANDSHAKE_THREADS = 32
# integrity checks: threads proving landed reads (each mostly waits on a peer's digests); one
# check per prefill engine at a time, so a prefill engine that does not answer holds one thread
CHECK_THREADS = 4
# finished reads' timings kept until take_timings (an engine that never asks keeps the latest)
MAX_TIMINGS = 1 << 16


@dataclass
class _Path:
    """One read route: our slice layout and prep, the peer's."""

    local: BlockLayout
    local_prep: PrepHandle
    remote: BlockLayout
    remote_prep: PrepHandle
    peer: str  # the agent peer it reads from (its notification is sealed for it)
    endpoint: str = ""  # the peer's side channel (integrity checks ask it for digests)
    part: tuple[int, int, int] = (1, 0, 0)  # (parts, offset, length) of its blocks that are read


@dataclass
class _Remote:
    """A prefill engine we have handshaken with."""

    tp_size: int
    peers: dict[int, str]  # remote rank -> agent peer name
    paths: list[_Path]
    notify_only: list[str]
    endpoints: tuple[str, ...] = ()  # what it was handshaken through: requests naming others re-handshake


def _restarted(remote: _Remote, src: RemoteSource) -> bool:
    """Whether the params of ``src`` name other prefill agents than the
    connection ``remote`` reaches (a name is drawn anew at each start).
    Params without names are not checked."""
    return bool(src.agents) and any(rank >= len(src.agents) or src.agents[rank] != name
                                    for rank, name in remote.peers.items())


@dataclass
class _Recv:
    req: RecvRequest
    transfers: list[Transfer] = field(default_factory=list)
    settled: bool = False        # reads posted (or given up): poll, then report
    error: str | None = None
    peer_lost: bool = False      # the prefill side died or went silent: forget it
    remote: "_Remote | None" = None  # the connection its reads use
    deadline: float = float("inf")
    posted: float = 0.0          # perf_counter when its reads were posted
    post_s: float = 0.0          # time spent posting them
    #: set on the retry of a read that failed with its peer lost: that peer's metadata back then
    retry_of: dict[str, bytes] | None = None
    first_error: str | None = None  # and why it failed the first time
    checking: Future | None = None  # integrity checks: proving the landed blocks
    queued: bool = False     # waiting for its prefill engine's check before it to end
    abandoned: bool = False  # its check is not wanted any more: the thread stops at its next step


@dataclass
class _Send:
    expires_at: float | None = None
    readers: set[str] = field(default_factory=set)
    expected: int = 1
    consumer_tp: int | None = None  # fixed by the first notification: later ones must agree
    seen: float = field(default_factory=time.monotonic)


def _address(t: Any) -> int:
    """Where a KV cache tensor (torch) or array (numpy) starts."""
    return t.data_ptr() if hasattr(t, "data_ptr") else t.__array_interface__["data"][0]


def _device(t: Any) -> str:
    """``"cpu"``, ``"cuda"``...: numpy arrays are host memory."""
    return getattr(getattr(t, "device", None), "type", "cpu")


class ConnectorWorker:
    """The connector of one TP rank.  ``copy_blocks`` replaces the torch
    copies used for host staging (``kv_buffer_device="cpu"``)."""

    def __init__(self, config: ConnectorConfig, tp_rank: int = 0, *, copy_blocks: CopyBlocks | None = None):
        if not (isinstance(tp_rank, (int, np.integer)) and not isinstance(tp_rank, bool)
                and 0 <= tp_rank < config.tp_size):
            raise InvalidArgument(f"tp_rank must be an int in [0, {config.tp_size}), got {tp_rank!r}")
        tp_rank = int(tp_rank)
        self.config, self.rank = config, tp_rank
        port = config.side_channel_port + tp_rank if config.side_channel_port else 0
        kvt_config = config.kvt_config(name=f"{config.engine_id}-tp{tp_rank}-{secrets.token_hex(3)}",
                                       listen_host=config.side_channel_host, listen_port=port)
        if kvt_config.integrity:
            integrity.require()  # at start, not as every read failing
        self.agent = Agent(config=kvt_config)
        self.consumer = f"{config.engine_id}:{tp_rank}"
        self.endpoint: str | None = None
        self._copy = copy_blocks
        self._staging: HostStaging | None = None
        self._card: WorkerCard | None = None
        self._layout: BlockLayout | None = None
        self._parts = 1
        self._meta = ConnectorMetadata()
        self._pool = ThreadPoolExecutor(HANDSHAKE_THREADS, thread_name_prefix=f"kvt-connector-handshake-{tp_rank}")
        self._checker = (ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix=f"kvt-connector-check-{tp_rank}")
                         if kvt_config.integrity else None)
        # per connection (engine id and endpoints, as handshakes: params naming an engine's id with other
        # endpoints get a queue of their own): reads landed and awaiting their check, the one being checked
        self._check_queue: dict[tuple, deque[_Recv]] = {}
        self._check_running: dict[tuple, _Recv] = {}
        self._memory = threading.Lock()  # held while a check reads our blocks: shutdown waits for it
        # in flight per (engine, endpoints): one per remote engine, unless a request names other endpoints
        self._handshakes: dict[tuple, tuple[Future, RemoteSource]] = {}
        self._waiting: dict[tuple, list[tuple[str, RecvRequest]]] = {}
        self._remotes: dict[str, _Remote] = {}
        self._retired: list[_Remote] = []  # dropped connections, released once no read uses them
        self._local_preps: dict[Slice, tuple[BlockLayout, PrepHandle]] = {}
        self._loading: dict[str, _Recv] = {}
        self._sends: dict[str, _Send] = {}
        self._early: dict[str, _Send] = {}  # notifications that came before their reqs_to_send
        self._released: OrderedDict[str, float] = OrderedDict()  # request -> monotonic time it was released
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._invalid: set[int] = set()
        self._failures: dict[str, str] = {}
        self._live = 0  # transfer handles posted and not yet released
        self.stats = dict.fromkeys(("reads", "bytes_read", "recv_ok", "recv_failed", "notified_only",
                                    "released_by_readers", "expired", "retried", "bad_notifs", "verified"), 0)
        self._warned_at = -QUIET
        # finished reads since take_timings
        self._timings: deque[tuple[float, float, int, int]] = deque(maxlen=MAX_TIMINGS)
        self._closed = False

    # -- registration ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> str:
        """Register this rank's KV cache (layer name -> torch tensor or numpy array, see
        ``KVCacheSpec`` for the shapes) and start serving our metadata.
        Returns the handshake endpoint.  ``InvalidArgument`` names a tensor
        whose shape or dtype does not match the spec."""
        self._check_open()
        if self._card is not None:
            raise InvalidArgument("register_kv_caches was already called for this worker")
        spec = self.config.kv
        if not isinstance(kv_caches, Mapping):
            raise InvalidArgument(f"register_kv_caches takes {{layer name: tensor}}, got {type(kv_caches).__name__}")
        if len(kv_caches) != spec.num_layers:
            raise InvalidArgument(f"got {len(kv_caches)} layers, the spec says num_layers={spec.num_layers}")
        buffers, seen = [], set()
        for name, value in kv_caches.items():
            for t in self._buffers_of(name, value):
                if _address(t) not in seen:  # layers may share one cache tensor
                    seen.add(_address(t))
                    buffers.append(t)
        if len({int(t.shape[0]) for t in buffers}) != 1:
            raise InvalidArgument("every KV cache tensor needs the same number of blocks (first dimension)")
        staging = None
        if self.config.staging:
            if not all(hasattr(t, "data_ptr") for t in buffers):
                raise InvalidArgument("host staging (kv_buffer_device='cpu') copies from device tensors: "
                                      "numpy arrays are host memory already, register them without it")
            staging = HostStaging(buffers, self._copy)
            buffers = staging.host
        elif self._checker is not None and any(_device(t) != "cpu" for t in buffers):
            # kvt.integrity digests host memory: every read would fail its check
            raise ConfigError(f"integrity checks digest host memory and this KV cache is on "
                              f"{buffers[0].device}: set kv_buffer_device='cpu' (host staging) or turn them off")
        layout = self.agent.register_blocks(_LAYOUT, buffers)
        parts = 2 if spec.kv_layout == "joined" else 1
        card = WorkerCard(engine_id=self.config.engine_id, tp_rank=self.rank, tp_size=self.config.tp_size,
                          spec=spec, layers=list(kv_caches), parts=parts)
        extra = dict(self.agent.extra)
        self.agent.extra.update(card.to_extra())
        try:
            self.endpoint = self.agent.listen()
        except BaseException:
            # (a busy port) the worker stays unregistered, so a retry can succeed; it registers
            # the layout again, which replaces this registration
            self.agent.extra.clear()
            self.agent.extra.update(extra)
            raise
        # only now: a set _card is what lets the steps run
        self._staging, self._layout, self._parts, self._card = staging, layout, parts, card
        return self.endpoint

    def _buffers_of(self, name: str, value: Any) -> list:
        spec = self.config.kv
        block = spec.block_shape(self.config.tp_size)
        if spec.kv_layout == "split":
            pair = list(value) if isinstance(value, (tuple, list)) else None
            if pair is None and getattr(value, "ndim", 0) == 2 + len(block) and value.shape[0] == 2:
                pair = [value[0], value[1]]
            if pair is None or len(pair) != 2:
                raise InvalidArgument(f"layer {name!r}: kv_layout 'split' takes a (2, num_blocks, *{block}) tensor "
                                      "or a (K, V) pair of (num_blocks, *block) tensors")
            want, got = (None, *block), pair
        elif spec.kv_layout == "joined":
            want, got = (None, 2, *block), [value]
        else:  # packed, mla
            want, got = (None, *block), [value]
        for t in got:
            shape = tuple(getattr(t, "shape", ()))
            if len(shape) != len(want) or shape[1:] != want[1:]:
                raise InvalidArgument(f"layer {name!r}: tensor of shape {shape} does not match the spec's (num_blocks, "
                                      f"{', '.join(map(str, want[1:]))}) for tp_size {self.config.tp_size}")
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype != spec.dtype:
                raise InvalidArgument(f"layer {name!r}: dtype {dtype} but the spec says {spec.dtype}")
        return got

    # -- per step -------------------------------------------------------------

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Take this step's metadata: hold ``reqs_to_send``, start handshakes
        and reads for ``reqs_to_recv``.  Returns at once."""
        self._check_ready()
        if not isinstance(meta, ConnectorMetadata):
            raise InvalidArgument(f"start_load_kv takes the step's ConnectorMetadata (a worker in another process: "
                                  f"ConnectorMetadata.decode() of what meta.encode() gave), got {type(meta).__name__}")
        self._meta = meta
        for req_id, expires_at in meta.reqs_to_send.items():
            self._hold(req_id, expires_at)
        for req_id, req in meta.reqs_to_recv.items():
            self._schedule(req_id, req)
        self._progress()

    def wait_for_save(self) -> None:
        """Host staging: copy this step's ``reqs_to_save`` blocks device -> host."""
        self._check_ready()
        if self._staging is not None and self._meta.reqs_to_save:
            self._staging.save(np.concatenate([np.asarray(v, np.int64) for v in self._meta.reqs_to_save.values()]))

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` since the last call.  A request in
        ``done_recving`` may have failed: check ``get_block_ids_with_load_errors``."""
        self._check_ready()
        self._progress()
        self._poll()
        self._take_notifs()
        self._expire()
        sending, self._done_sending = self._done_sending, set()
        recving, self._done_recving = self._done_recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call (reported no
        later than the ``get_finished`` that returns their request)."""
        out, self._invalid = self._invalid, set()
        return out

    def take_timings(self) -> list[tuple[float, float, int, int]]:
        """``(post_seconds, transfer_seconds, bytes, blocks)`` of every read
        that landed since the last call (for the engine's metrics; the latest
        ``MAX_TIMINGS``); the time a read waits for its handshake is not
        counted, the time its blocks take to be proven (integrity checks) is."""
        out, self._timings = list(self._timings), deque(maxlen=MAX_TIMINGS)
        return out

    def failure_reasons(self) -> dict[str, str]:
        """Why each failed request failed, since the last call (for logs)."""
        out, self._failures = self._failures, {}
        return out

    def outstanding(self) -> dict[str, int]:
        """What this worker still holds; all zero once every request settled."""
        return {"loading": len(self._loading), "transfers": self._live, "held": len(self._sends),
                "checks": (sum(not r.checking.done() for r in self._check_running.values())
                           + sum(not r.abandoned for q in self._check_queue.values() for r in q)),
                "early_notifs": len(self._early), "handshakes": len(self._handshakes),
                "waiting": sum(map(len, self._waiting.values())), "retired": len(self._retired),
                "unreported": len(self._done_sending) + len(self._done_recving) + len(self._invalid)}

    # -- prefill side ---------------------------------------------------------

    def _hold(self, req_id: str, expires_at: float) -> None:
        self._released.pop(req_id, None)  # a new hold under a reused id: its readers count from now
        entry = self._early.pop(req_id, None) or _Send()
        entry.expires_at = expires_at
        if entry.readers and len(entry.readers) >= entry.expected:
            self._release_send(req_id)
        else:
            self._sends[req_id] = entry

    def _take_notifs(self) -> None:
        for sender, msgs in self.agent.get_notifs().items():
            for raw in msgs:
                try:
                    n = ReadNotif.decode(raw)
                except WireError as e:
                    self._bad_notif(sender, e)
                    continue
                if why := self._reader_problem(sender, n):
                    self._bad_notif(sender, why)
                    continue
                entry = self._sends.get(n.request_id)
                if entry is None:
                    if n.request_id in self._released:
                        continue  # a repeat, or a reader after expiry: the blocks are freed already
                    entry = self._early_entry(n.request_id)
                    if entry is None:
                        continue
                if entry.consumer_tp is None:  # the first reader fixes how many readers to wait for
                    entry.consumer_tp = n.consumer_tp
                    entry.expected = readers_per_rank(self.config.tp_size, n.consumer_tp)
                elif n.consumer_tp != entry.consumer_tp:
                    self._bad_notif(sender, f"request {n.request_id!r}: reader {n.consumer!r} says decode TP "
                                            f"{n.consumer_tp}, an earlier reader said {entry.consumer_tp}")
                    continue
                entry.readers.add(n.consumer)
                if n.request_id in self._sends and len(entry.readers) >= entry.expected:
                    del self._sends[n.request_id]
                    self._release_send(n.request_id)

    def _reader_problem(self, sender: str, n: ReadNotif) -> str | None:
        """Why ``n`` cannot count as one of our readers: its consumer must be
        ``engine:rank`` of the agent that sent it (``engine-tp{rank}-...``), a
        rank of ``consumer_tp`` that reads from this rank."""
        engine, sep, rank = n.consumer.rpartition(":")
        if not sep or not (rank.isascii() and rank.isdigit()) or len(rank) > 4:
            return f"reader {n.consumer[:80]!r} is not 'engine:rank'"
        r = int(rank)
        if not sender.startswith(f"{engine}-tp{r}-"):
            return f"reader {n.consumer[:80]!r} is not the agent that sent it"
        try:
            reads_us = r < n.consumer_tp and self.rank in remote_ranks(r, n.consumer_tp, self.config.tp_size)
        except IncompatiblePeer:
            reads_us = False
        if not reads_us:
            return (f"decode rank {r} of TP {n.consumer_tp} does not read from prefill rank {self.rank} of TP "
                    f"{self.config.tp_size}")
        return None

    def _bad_notif(self, sender: str, e: "WireError | str") -> None:
        # counted always, logged at most once per QUIET seconds: a flooding peer must not fill the log
        self.stats["bad_notifs"] += 1
        if (now := time.monotonic()) - self._warned_at >= QUIET:
            self._warned_at = now
            log.warning("ignoring a notification from %s: %s (%d ignored so far; at most one such line per "
                        "%gs)", sender, e, self.stats["bad_notifs"], QUIET)

    def _early_entry(self, req_id: str) -> _Send | None:
        """The entry of a request not held yet (before its reqs_to_send); None
        once it has all the readers we keep."""
        entry = self._early.get(req_id)
        if entry is None:
            if len(self._early) >= MAX_EARLY:
                del self._early[next(iter(self._early))]
            entry = self._early[req_id] = _Send()
        return entry if len(entry.readers) < MAX_EARLY_READERS else None

    def _release_send(self, req_id: str) -> None:
        self.stats["released_by_readers"] += 1
        self._released_now(req_id)

    def _released_now(self, req_id: str) -> None:
        self._done_sending.add(req_id)
        self._released.pop(req_id, None)
        if len(self._released) >= MAX_RELEASED:
            self._released.popitem(last=False)
        self._released[req_id] = time.monotonic()

    def _expire(self) -> None:
        now, mono = time.time(), time.monotonic()
        for req_id in [r for r, s in self._sends.items() if s.expires_at is not None and now >= s.expires_at]:
            s = self._sends.pop(req_id)
            log.warning("releasing request %s: its blocks expired after %d of %d readers",
                        req_id, len(s.readers), s.expected)
            self.stats["expired"] += 1
            self._released_now(req_id)
        ttl = max(RELEASED_TTL, 2 * (self.agent.config.transfer_timeout + _SLACK))  # a late reader's ok=False
        while self._released and mono - next(iter(self._released.values())) > ttl:
            self._released.popitem(last=False)
        while self._early:  # oldest first: a reader of a request we never held (or already released)
            req_id, s = next(iter(self._early.items()))
            if mono - s.seen <= self.config.abort_request_timeout:
                break
            del self._early[req_id]

    # -- decode side ----------------------------------------------------------

    def _schedule(self, req_id: str, req: RecvRequest, retry_of: dict[str, bytes] | None = None,
                  first_error: str | None = None) -> None:
        if req.local_block_ids:
            if req_id in self._loading:
                raise InvalidArgument(f"request {req_id!r} is already loading on this worker")
            self._loading[req_id] = _Recv(req, retry_of=retry_of, first_error=first_error)
        src = req.remote
        key = (src.engine_id, tuple(src.endpoints))
        remote = self._remotes.get(src.engine_id)
        if remote is not None and remote.endpoints == key[1] and not _restarted(remote, src):
            self._start(req_id, req, remote)
            return
        # a request naming other endpoints for a known engine (a restart on new ports, or params
        # pointing elsewhere) handshakes with them: it never reads through another request's connection;
        # so does one naming other agents (a restart, before or after its hand-off: the handshake says)
        self._waiting.setdefault(key, []).append((req_id, req))
        if key not in self._handshakes:
            self._handshakes[key] = (self._pool.submit(self._handshake, src), src)

    def _handshake(self, src: RemoteSource) -> list[tuple[int, AgentInfo]]:
        """Background thread: fetch and check the metadata of every prefill
        rank we read from.  No backend calls here."""
        out, deadline = [], time.monotonic() + self.agent.config.handshake_timeout
        for rank in remote_ranks(self.rank, self.config.tp_size, src.tp_size):
            if rank >= len(src.endpoints):
                raise IncompatiblePeer(f"no endpoint for prefill rank {rank} of engine {src.engine_id!r}")
            # one handshake_timeout for all ranks: a request (and this thread) waits no longer,
            # however many ranks its params name
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeTimeout(f"handshakes with the {src.tp_size} ranks of prefill engine "
                                       f"{src.engine_id!r} took over {self.agent.config.handshake_timeout:g}s")
            info = fetch_info(src.endpoints[rank], self.agent.name, left, self.agent.secret)
            check_peer(self._card, WorkerCard.from_info(info), engine_id=src.engine_id, rank=rank,
                       tp_size=src.tp_size)
            out.append((rank, info))
        return out

    def _progress(self) -> None:
        """Connect finished handshakes and start their waiting requests."""
        for key, (fut, src) in list(self._handshakes.items()):
            if not fut.done():
                continue
            del self._handshakes[key]
            waiting, engine_id = self._waiting.pop(key, []), src.engine_id
            remote = self._remotes.get(engine_id)
            try:
                # else connected meanwhile (a retry), to the processes this handshake reached
                if (remote is None or remote.endpoints != key[1]
                        or (fut.exception() is None and any(remote.peers.get(rank) != info.name
                                                            for rank, info in fut.result()))):
                    remote = self._connect(engine_id, src.tp_size, tuple(src.endpoints), fut.result())
                    if (old := self._remotes.get(engine_id)) is not None:
                        self._retired.append(old)  # released once no read uses it
                    self._remotes[engine_id] = remote
            except Exception as e:  # a bug must fail the requests too, never pass them as loaded
                if not isinstance(e, KvtError):
                    log.exception("handshake with engine %s failed", engine_id)
                why = f"handshake with prefill engine {engine_id!r} failed: {type(e).__name__}: {e}"
                for req_id, req in waiting:
                    self._give_up(req_id, req, why)
                continue
            for req_id, req in waiting:
                self._start(req_id, req, remote)

    def _connect(self, engine_id: str, tp_size: int, endpoints: tuple[str, ...],
                 infos: list[tuple[int, AgentInfo]]) -> _Remote:
        peers: dict[int, str] = {}
        preps: list[PrepHandle] = []
        try:
            for rank, info in infos:
                peers[rank] = self.agent.add_peer(info)
            card = WorkerCard.from_info(infos[0][1])
            local_part = self._layout.block_len // self._parts
            remote = {rank: info.layouts.get(_LAYOUT) for rank, info in infos}
            paths = []
            for rank, lay in remote.items():
                if lay is None or len(lay.base_addrs) * card.parts != len(self._layout.base_addrs) * self._parts:
                    raise IncompatiblePeer(f"prefill rank {rank} of {engine_id!r} registers "
                                           f"{0 if lay is None else len(lay.base_addrs) * card.parts} KV parts "
                                           f"per block, we register {len(self._layout.base_addrs) * self._parts}")
            first = remote[infos[0][0]]
            plan = plan_reads(self.rank, self.config.tp_size, tp_size, local_part, first.block_len // card.parts,
                              self.config.kv.mla)
            for read in plan.reads:
                local, local_prep = self._local_prep(read.local)
                rl = part_layout(remote[read.remote_rank], card.parts, read.remote)
                preps.append(self.agent.backend.prep(peers[read.remote_rank], rl.descs()))
                paths.append(_Path(local, local_prep, rl, preps[-1], peers[read.remote_rank],
                                   endpoints[read.remote_rank], (card.parts, read.remote.offset, read.remote.length)))
        except Exception as e:  # whatever failed, the peers loaded so far go (they piled up otherwise)
            for h in preps:
                self._quietly(self.agent.backend.release, h)
            for peer in peers.values():
                self._quietly(self.agent.remove_peer, peer)
            if isinstance(e, ValueError):  # a rank's layout that cannot be cut as the first rank's
                raise IncompatiblePeer(f"prefill engine {engine_id!r}: its ranks' layouts cannot be read "
                                       f"alike: {e}") from None
            raise
        return _Remote(tp_size, peers, paths, [peers[r] for r in plan.notify_only], endpoints)

    def _local_prep(self, sl: Slice) -> tuple[BlockLayout, PrepHandle]:
        if sl not in self._local_preps:
            lay = part_layout(self._layout, self._parts, sl)
            self._local_preps[sl] = (lay, self.agent.backend.prep(None, lay.descs()))
        return self._local_preps[sl]

    def _start(self, req_id: str, req: RecvRequest, remote: _Remote) -> None:
        try:
            self._start_reads(req_id, req, remote)
        except Exception as e:  # a bug must fail the request, never escape into the engine's step
            log.exception("request %s: starting its read failed", req_id)
            self._give_up(req_id, req, f"starting the read failed: {type(e).__name__}: {e}")

    def _start_reads(self, req_id: str, req: RecvRequest, remote: _Remote) -> None:
        src = req.remote
        notif = ReadNotif(src.request_id, self.consumer, self.config.tp_size).encode()
        if remote.tp_size != src.tp_size:
            self._give_up(req_id, req, f"prefill engine {src.engine_id!r} has TP {remote.tp_size}, the request "
                                       f"says {src.tp_size}; restart the decode engine to re-handshake")
            return
        if _restarted(remote, src):  # the params' processes are gone: these ids name others' blocks
            self._give_up(req_id, req, f"prefill engine {src.engine_id!r} restarted after it handed the request "
                                       "off; its blocks died with the old process (recompute it)")
            return
        if not req.local_block_ids:  # nothing to read: let the prefill side free now
            self._notify(remote.peers.values(), notif)
            self.stats["notified_only"] += 1
            return
        if why := self._lease_problem(src.expires_at):
            self._give_up(req_id, req, why)
            return
        recv = self._loading[req_id]
        # params that name the prefill agents were checked just above; without them, a retry reads
        # only from the incarnation the first attempt did
        if recv.retry_of is not None and not src.agents and self._incarnations(remote) != recv.retry_of:
            self._give_up(req_id, req, f"prefill engine {src.engine_id!r} restarted; the request's blocks "
                                       "died with its old process (recompute it)")
            return
        recv.settled, recv.remote = True, remote
        recv.deadline = time.monotonic() + self.agent.config.transfer_timeout + _SLACK
        recv.posted = time.perf_counter()
        try:
            if len(req.local_block_ids) != len(src.block_ids):
                raise InvalidArgument(f"{len(req.local_block_ids)} local blocks for {len(src.block_ids)} remote blocks")
            for path in remote.paths:
                lidx = Agent.block_index(path.local, req.local_block_ids)
                ridx = Agent.block_index(path.remote, src.block_ids)
                # with integrity checks the prefill side hears from us once the blocks are proven
                attached = None if self._checker else self.agent.notif_for(path.peer, notif)
                h = self.agent.backend.transfer(Op.READ, path.local_prep, lidx, path.remote_prep, ridx, attached)
                self._live += 1
                recv.transfers.append(Transfer(self.agent, h, int(lidx.size) * path.local.block_len))
            self._notify(remote.notify_only, notif)
        except KvtError as e:
            recv.error = f"posting the read failed: {type(e).__name__}: {e}"
        recv.post_s = time.perf_counter() - recv.posted

    def _incarnations(self, remote: "_Remote") -> dict[str, bytes] | None:
        """The backend metadata of a connection's peers: it changes when a peer
        restarts.  None when a peer is not known any more (treat as changed)."""
        try:
            return {p: self.agent.peer_info(p).metadata for p in remote.peers.values()}
        except KvtError as e:
            log.debug("incarnations of %s: %s", sorted(remote.peers.values()), e)
            return None

    def _give_up(self, req_id: str, req: RecvRequest, why: str) -> None:
        log.warning("request %s: %s", req_id, why)
        recv = self._loading.get(req_id)
        if recv is not None:
            recv.settled, recv.error = True, why

    def _lease_problem(self, expires_at: float | None) -> str | None:
        if expires_at is None:
            return None
        left = expires_at - time.time()
        if left <= self.config.expiry_margin:
            return (f"the prefill side's lease on the blocks ends in {left:.2f}s (margin "
                    f"{self.config.expiry_margin:g}s); they may be reused, so they are not read")
        return None

    def _poll(self) -> None:
        now = time.monotonic()
        for req_id, recv in list(self._loading.items()):
            if not recv.settled:
                continue  # its handshake is still running
            pending = False
            for t in recv.transfers:
                try:
                    state = t.state()
                except KvtError as e:
                    recv.error = recv.error or f"read state unknown: {type(e).__name__}: {e}"
                    continue
                if state.pending:
                    pending = True
                elif state.failed and recv.error is None:
                    recv.error = f"read failed: {type(state.cause).__name__}: {state.cause}"
                    recv.peer_lost = isinstance(state.cause, (PeerDisconnected, TransferTimeout))
            if pending and now < recv.deadline:
                continue  # even after an error: let the rest settle before releasing
            if pending:
                recv.error = recv.error or (f"read did not finish within "
                                            f"{self.agent.config.transfer_timeout + _SLACK:g}s")
                recv.peer_lost = True
            elif self._checker is not None and recv.error is None and recv.transfers and self._proving(recv, now):
                continue
            try:
                self._finish(req_id, recv)
            except Exception as e:  # a bug must fail the request, never escape into the engine's step
                log.exception("request %s: finishing its read failed", req_id)
                self._fail_hard(req_id, recv, f"finishing the read failed: {type(e).__name__}: {e}")
        for conn in [*self._check_queue.keys() | self._check_running.keys()]:
            self._next_check(conn)  # drops the checks given up and the finished ones
        if self._retired:
            self._reap()

    def _proving(self, recv: _Recv, now: float) -> bool:
        """Integrity checks: True while ``recv``'s landed blocks wait for their
        check or are being proven; its error is set when they could not be
        within the budget (counted from when they landed)."""
        # each path's digests within a handshake_timeout (per_request ids at a time: once for most reads)
        budget = (self.agent.config.handshake_timeout + _SLACK) * len(recv.remote.paths)
        conn = (recv.req.remote.engine_id, tuple(recv.req.remote.endpoints))
        if not recv.queued:
            recv.queued, recv.deadline = True, now + budget
            self._check_queue.setdefault(conn, deque()).append(recv)
        if recv.checking is None or recv.checking.done():
            self._next_check(conn)  # ours, or the next one now that ours ended
        if recv.checking is None or not recv.checking.done():
            if now < recv.deadline:
                return True
            recv.error = f"IntegrityError: its blocks were not proven within {budget:g}s"
            recv.abandoned = True
            if recv.checking is not None:
                recv.checking.cancel()
        elif (e := recv.checking.exception()) is not None:
            recv.error = f"{type(e).__name__}: {e}"
        return False

    def _next_check(self, conn: tuple) -> None:
        """Start the next check of the reads through connection ``conn``
        unless one is running; forget it once it has none."""
        running = self._check_running.get(conn)
        if running is not None and not running.checking.done():
            return
        queue = self._check_queue.get(conn)
        while queue:
            recv = queue.popleft()
            if not recv.abandoned:
                recv.checking = self._checker.submit(self._check, recv)
                self._check_running[conn] = recv
                return
        self._check_queue.pop(conn, None)
        self._check_running.pop(conn, None)

    def _check(self, recv: _Recv) -> None:
        """Checker thread: prove every path's landed blocks against the
        prefill rank's own (``IntegrityError`` otherwise)."""
        req, src = recv.req, recv.req.remote
        for path in recv.remote.paths:
            with self._our_blocks(recv):
                integrity.maybe_flip(path.local, req.local_block_ids)  # the test hook: off unless set
            integrity.verify(path.local, req.local_block_ids, path.remote, src.block_ids,
                             partial(self._digests, recv, path),
                             f"read of {len(req.local_block_ids)} blocks of request {src.request_id!r} from "
                             f"peer {path.peer!r}", hold=partial(self._our_blocks, recv))

    @contextmanager
    def _our_blocks(self, recv: _Recv):
        """Checker thread: our blocks may be read inside (``shutdown`` waits
        for that before it deregisters them); ``ClosedError`` once the worker
        is shut down or the check abandoned."""
        with self._memory:
            self._check_wanted(recv)
            yield

    def _check_wanted(self, recv: _Recv) -> None:
        if self._closed or recv.abandoned:
            raise ClosedError("the check was given up (the worker shut down, or the request ran out of time)")

    def _digests(self, recv: _Recv, path: _Path, ids: np.ndarray) -> np.ndarray:
        """The prefill rank's digests of ``ids`` of the part of its blocks ``path`` reads."""
        self._check_wanted(recv)
        parts, offset, length = path.part
        return self.agent.ask_digests(path.endpoint, integrity.DigestRequest(
            layout=_LAYOUT, block_ids=ids.tobytes(), parts=parts, offset=offset, length=length))

    def _fail_hard(self, req_id: str, recv: _Recv, why: str) -> None:
        """Report ``req_id`` failed whatever state ``_finish`` left it in."""
        recv.abandoned = True
        if self._loading.get(req_id) is recv:
            del self._loading[req_id]
            for t in recv.transfers:
                self._quietly(Transfer.release, t)
                self._live -= 1
        elif req_id in self._loading:
            return  # it was rescheduled (a retry): that one reports it
        self.stats["recv_failed"] += 1
        self._invalid.update(recv.req.local_block_ids)
        self._failures[req_id] = why
        self._done_recving.add(req_id)

    def _finish(self, req_id: str, recv: _Recv) -> None:
        del self._loading[req_id]
        recv.abandoned = True  # a check still queued or running is not wanted any more
        for t in recv.transfers:
            self._quietly(Transfer.release, t)
            self._live -= 1
        ids = recv.req.local_block_ids
        if recv.error is None and recv.transfers:
            if why := self._lease_problem(recv.req.remote.expires_at):
                recv.error = f"the read finished too late: {why}"
        if recv.error is None and self._staging is not None:
            try:
                self._staging.load(ids)
            except Exception as e:
                log.exception("request %s: copying its blocks host -> device failed", req_id)
                recv.error = f"copying the blocks host -> device failed: {type(e).__name__}: {e}"
        if recv.error is None:
            if recv.checking is not None:  # proven: the prefill side may free them now
                self.stats["verified"] += 1
                self._notify({p.peer for p in recv.remote.paths},
                             ReadNotif(recv.req.remote.request_id, self.consumer, self.config.tp_size).encode())
            self.stats["reads"] += len(recv.transfers)
            self.stats["bytes_read"] += sum(t.nbytes for t in recv.transfers)
            self.stats["recv_ok"] += 1
            self._timings.append((recv.post_s, time.perf_counter() - recv.posted,
                                  sum(t.nbytes for t in recv.transfers), len(ids)))
        else:
            src = recv.req.remote
            if recv.peer_lost and self._remotes.get(src.engine_id) is recv.remote:
                # the next request re-handshakes (e.g. with a restarted engine)
                self._retired.append(self._remotes.pop(src.engine_id))
            if (recv.peer_lost and recv.retry_of is None and recv.remote is not None
                    and self._lease_problem(src.expires_at) is None):
                # the retry reads only from the same incarnation: checked in _start, also when
                # another request re-handshook the engine already and the retry starts at once
                if (before := self._incarnations(recv.remote)) is not None:
                    log.warning("request %s: %s; retrying once after a new handshake", req_id, recv.error)
                    self.stats["retried"] += 1
                    self._schedule(req_id, recv.req, retry_of=before, first_error=recv.error)
                    return
                recv.error += "; not retried: the connection's peer is gone"
            self.stats["recv_failed"] += 1
            self._invalid.update(ids)
            self._failures[req_id] = (recv.error if recv.first_error is None
                                      else f"{recv.first_error}; retried once: {recv.error}")
            if not recv.peer_lost and recv.remote is not None:  # tell the prefill side we are done with the blocks
                self._notify(recv.remote.peers.values(), ReadNotif(src.request_id, self.consumer,
                                                                   self.config.tp_size, ok=False).encode())
        self._done_recving.add(req_id)

    def _reap(self) -> None:
        """Release retired connections that no read uses any more; a peer
        stays while any connection still in use (current, or retired with a
        read in flight) names it."""
        busy = {id(r.remote) for r in self._loading.values()}
        in_use = [*self._remotes.values(), *(r for r in self._retired if id(r) in busy)]
        live = {p for r in in_use for p in r.peers.values()}
        for remote in [r for r in self._retired if id(r) not in busy]:
            self._retired.remove(remote)
            for path in remote.paths:
                self._quietly(self.agent.backend.release, path.remote_prep)
            for peer in set(remote.peers.values()) - live:
                self._quietly(self.agent.remove_peer, peer)

    @staticmethod
    def _quietly(fn, arg) -> None:
        try:
            fn(arg)
        except KvtError as e:  # already gone with the peer; nothing left to free
            log.debug("%s(%r): %s", getattr(fn, "__name__", fn), arg, e)

    def _notify(self, peers, msg: bytes) -> None:
        for peer in peers:
            try:
                self.agent.notify(peer, msg)
            except Exception as e:  # the prefill side then frees on expiry
                log.warning("notifying %s: %s: %s", peer, type(e).__name__, e)

    # -- lifecycle ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"connector worker {self.consumer} is shut down")

    def _check_ready(self) -> None:
        self._check_open()
        if self._card is None:
            raise InvalidArgument("call register_kv_caches before the first step")

    def shutdown(self) -> None:
        """Release every transfer, peer and registration.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._checker is not None:
            self._checker.shutdown(wait=False, cancel_futures=True)
            with self._memory:  # a digest of our blocks in progress ends before they are deregistered
                pass
        for recv in self._loading.values():
            for t in recv.transfers:
                self._quietly(Transfer.release, t)
                self._live -= 1
        self._loading.clear()
        self.agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"ConnectorWorker({self.consumer!r}, backend={self.agent.backend_name!r})"
