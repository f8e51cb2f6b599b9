"""Scheduler side of the connector: one per engine, next to its scheduler.

It decides, per request, what the workers must do, and hands it to them as
``ConnectorMetadata`` once per step.  It never touches the network.  Calls,
in the order an engine makes them::

    # decode engine, a new request carrying the prefill side's kv_transfer_params
    n, load_async = sched.get_num_new_matched_tokens(req, num_computed_tokens)
    ... allocate blocks for the prompt ...
    sched.update_state_after_alloc(req, block_ids, n)
    meta = sched.build_connector_meta()           # -> every worker's start_load_kv
    ... workers' get_finished, combined with FinishedAggregator ...
    sched.update_connector_output(done_sending, done_recving)

    # prefill engine, a request with {"do_remote_decode": true}
    sched.update_state_after_alloc(req, block_ids, 0)
    ... prefill runs ...
    delay_free, params = sched.request_finished(req, block_ids)
    # params go back to the router; if delay_free, free the blocks only once
    # the request id comes back from every worker in done_sending

A prefill engine first tells its scheduler where its workers are::

    sched.set_worker_endpoints({rank: endpoint}, {rank: agent_name})  # each worker's
                                                    # register_kv_caches() and agent.name

Requests are anything with ``request_id``, ``num_prompt_tokens``,
``prompt_token_ids`` and a mutable ``kv_transfer_params`` dict
(``EngineRequest`` is a ready one).  Only
whole blocks move: the tail of a prompt that does not fill a block is
computed by the decode engine, so a prompt shorter than one block moves
nothing and the prefill side frees it at once.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from ..auth import Secret
from ..errors import InvalidArgument
from .config import ConnectorConfig
from .metadata import ConnectorMetadata, RecvRequest, RemoteSource, TransferParams
from .tp import tp_problem

__all__ = ["Request", "EngineRequest", "ConnectorScheduler", "FinishedAggregator", "prompt_identity"]

log = logging.getLogger(__name__)


class Request(Protocol):
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # and ``prompt_token_ids``, which bind a hand-off to its prompt (see ``prompt_identity``);
    # only requests from prompt embeddings go without


@dataclass
class EngineRequest:
    """A minimal ``Request`` for engines without their own request object."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = field(default=None)
    prompt_token_ids: Sequence[int] | None = None


#: the longest request id the connector carries (kv_transfer_params name ids of at most this many characters)
MAX_REQUEST_ID = 1024


def _request_id(request: Request) -> str:
    """The request's id as the step's metadata carries it; ``InvalidArgument``
    when it cannot (not text, a lone surrogate a client put in a JSON id,
    longer than ``MAX_REQUEST_ID``): refused before any state is kept, or
    the step's metadata would fail to encode, for every request in it."""
    rid = request.request_id
    try:
        if isinstance(rid, str) and len(rid) <= MAX_REQUEST_ID and rid.encode():
            return rid
    except UnicodeEncodeError:
        pass
    raise InvalidArgument(f"request id {str(rid)[:80]!r} cannot travel between engines (text of at most "
                          f"{MAX_REQUEST_ID} characters, valid UTF-8): the request runs without the connector")


def _count(value: Any, what: str) -> int:
    """``value`` as a count (an int, numpy's too; not a bool); ``InvalidArgument`` otherwise."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise InvalidArgument(f"{what} must be an int, got {type(value).__name__} {str(value)[:40]!r}")


def _blocks(block_ids: Any) -> Sequence[int]:
    """``block_ids`` if it is a sequence of block ids (a list, tuple, range,
    numpy array...); ``InvalidArgument`` otherwise."""
    if hasattr(block_ids, "__len__") and hasattr(block_ids, "__getitem__") \
            and not isinstance(block_ids, (str, bytes, Mapping)):
        return block_ids
    raise InvalidArgument(f"block_ids must be a sequence of block ids (e.g. a list of ints), "
                          f"got {type(block_ids).__name__}")


def _id_array(block_ids: Sequence[int]) -> np.ndarray:
    """``block_ids`` as a 1-D array of ints in [0, 2**63); ``InvalidArgument``
    otherwise.  Checked whole, before any state changes: floats (which a
    worker's decode refuses) or negative ids would otherwise break the step's
    metadata for every request in it."""
    try:
        arr = np.asarray(block_ids)
    except (TypeError, ValueError, OverflowError):  # ragged, or ints past uint64
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0
                                                      or (arr.dtype.kind == "u" and arr.max() >= 2**63))):
        shown = f"dtype {arr.dtype}, shape {arr.shape}" if arr is not None else type(block_ids).__name__
        raise InvalidArgument(f"block_ids must be a sequence of block ids, ints in [0, 2**63), got {shown}")
    return arr


def _ids(block_ids: Sequence[int]) -> list[int]:
    """Checked block ids as Python ints (numpy's do not encode); vectorised, no per-id Python loop."""
    return _id_array(block_ids).tolist()


def prompt_identity(request: Request) -> bytes | None:
    """What a request's KV is computed from, as bytes: its prompt token ids
    (little-endian int64).  ``None`` when the request has none (prompt
    embeddings): its hand-off then names no prompt.  Engines whose KV also
    depends on more than the tokens (adapters, images) pass their own to
    ``ConnectorScheduler`` (the vLLM adapter adds LoRA and multimodal inputs)."""
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens is None:
        return None
    try:
        return np.asarray(tokens, "<i8").tobytes()
    except (ValueError, TypeError, OverflowError):  # not token ids: names no prompt
        return None


class _Spent:
    """Prefill requests this engine already read from or released, kept until
    their lease ends: params used twice (a router's retry, a replay) would
    read blocks the prefill engine has freed and maybe given to another
    request.  At most ``MAX`` entries; past it, the one whose lease ends
    first is dropped.  Keys are kept as 16-byte BLAKE2b digests (ids may be
    1 KiB each) and expire through a heap, whatever order leases end in."""

    MAX = 1 << 20
    _USER_CHARS = 256  # of our request id, for the error message

    def __init__(self) -> None:
        self._by: dict[bytes, tuple[float, str]] = {}  # digest(engine, request) -> (until, our request)
        self._heap: list[tuple[float, int, bytes]] = []  # (until, seq, digest); stale ones skipped when popped
        self._seq = 0  # equal leases: the oldest goes first

    @staticmethod
    def _digest(key: tuple[str, str]) -> bytes:
        h = hashlib.blake2b(digest_size=16, person=b"kvt-spent-params")
        for part in key:
            raw = part.encode("utf-8", "surrogatepass")
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        return h.digest()

    def user(self, key: tuple[str, str]) -> str | None:
        """Our request that used ``key``, if its lease has not ended."""
        hit = self._by.get(self._digest(key))
        return hit[1] if hit is not None and hit[0] > time.time() else None

    def _pop(self) -> None:
        until, _, digest = heapq.heappop(self._heap)
        if self._by.get(digest, (None,))[0] == until:
            del self._by[digest]

    def add(self, key: tuple[str, str], until: float, req_id: str) -> None:
        now = time.time()
        while self._heap and (self._heap[0][0] <= now or len(self._by) >= self.MAX):
            self._pop()
        if len(self._heap) > 2 * self.MAX:  # pairs left by keys added again: rebuild
            self._heap = [e for e in self._heap if self._by.get(e[2], (None,))[0] == e[0]]
            heapq.heapify(self._heap)
        digest = self._digest(key)
        self._by[digest] = (until, req_id[:self._USER_CHARS])
        self._seq += 1
        heapq.heappush(self._heap, (until, self._seq, digest))


class _Checked:
    """Decode requests' params already parsed and checked, by request id, kept
    until the request is scheduled or ends (at most ``MAX``; past it the
    oldest is dropped and parsed again when asked).  An entry counts only
    for the very params it was made from: the same dict, holding the same
    keys and value objects, with ``do_remote_prefill`` still set."""

    MAX = 1024
    _FLAGS = ("do_remote_prefill", "do_remote_decode")  # the engine flips these; they are not checked

    def __init__(self) -> None:
        self._by: OrderedDict[str, tuple[Mapping, tuple, TransferParams]] = OrderedDict()

    @classmethod
    def _items(cls, params: Mapping) -> tuple:
        return tuple((k, v) for k, v in params.items() if k not in cls._FLAGS)

    def get(self, req_id: str, params: Any) -> TransferParams | None:
        hit = self._by.get(req_id)
        if hit is None or hit[0] is not params or not params.get("do_remote_prefill"):
            return None
        items = self._items(params)
        same = len(items) == len(hit[1]) and all(k == j and v is w for (k, v), (j, w) in zip(items, hit[1]))
        return hit[2] if same else None

    def put(self, req_id: str, params: Mapping, p: TransferParams) -> None:
        self._by.pop(req_id, None)
        if len(self._by) >= self.MAX:
            self._by.popitem(last=False)
        self._by[req_id] = (params, self._items(params), p)

    def pop(self, req_id: str, params: Any) -> TransferParams | None:
        p = self.get(req_id, params)
        self.discard(req_id)
        return p

    def discard(self, req_id: str) -> None:
        self._by.pop(req_id, None)


class ConnectorScheduler:
    """Scheduler side of one engine."""

    def __init__(self, config: ConnectorConfig, identity: Callable[[Request], bytes | None] = prompt_identity):
        self.config = config
        self._identity = identity  # what binds a hand-off to its prompt (prompt_identity)
        key = config.kvt_config().auth_key
        self._secret = Secret(key) if key is not None else None  # signs and checks kv_transfer_params
        self._endpoints: list[str] = []  # the workers' handshake endpoints and agent names,
        self._agents: list[str] = []  # once set_worker_endpoints gave them
        self._to_recv: dict[str, RecvRequest] = {}
        self._to_save: dict[str, list[int]] = {}
        self._to_send: dict[str, float] = {}
        self._loading: set[str] = set()
        self._saved: dict[str, np.ndarray] = {}  # host staging: each prefill request's blocks so far
        self._spent = _Spent()
        self._checked = _Checked()
        self._warned_unbound = False  # a hand-off named no prompt (logged once)

    def set_worker_endpoints(self, endpoints: Mapping[int, str], agents: Mapping[int, str]) -> None:
        """The handshake endpoint of every rank (each worker's
        ``register_kv_caches`` returns its own) and its agent name
        (``ConnectorWorker.agent.name``).  A prefill engine hands nothing off
        before this call, fixed ``side_channel_port`` or not: the names tell
        decode engines which processes hold the blocks, so none reads them
        from a restart of ours (same ids and ports, other contents: it draws
        new names) and none gives up a request of the restart over a
        connection to the process before."""
        ranks = list(range(self.config.tp_size))
        if not (isinstance(endpoints, Mapping) and isinstance(agents, Mapping)) \
                or set(endpoints) != set(ranks) or set(agents) != set(ranks):
            raise InvalidArgument(f"need one endpoint and one agent name per rank 0..{self.config.tp_size - 1}, as "
                                  f"{{rank: value}} mappings, got {str(endpoints)[:120]} and {str(agents)[:120]}")
        listed, names = [endpoints[r] for r in ranks], [agents[r] for r in ranks]
        try:  # as decode engines will parse them from our params
            if not all(names):
                raise InvalidArgument("empty name")
            TransferParams.parse({"remote_endpoints": listed, "remote_agents": names, "tp_size": len(listed)})
        except InvalidArgument:
            raise InvalidArgument(f"worker endpoints must be tcp://host:port strings (what register_kv_caches "
                                  f"returns) and agent names non-empty strings of up to 256 characters (each "
                                  f"worker's agent.name), got {listed[:4]!r}, {names[:4]!r}") from None
        self._endpoints, self._agents = listed, names

    # -- decode side ----------------------------------------------------------

    def _source(self, request: Request) -> TransferParams | None:
        """The request's params if it is to be read from a prefill engine;
        ``InvalidArgument`` if they cannot be.  Parsed and checked once per
        request (vLLM asks again every step a request waits for blocks, and
        the tag of 100,000 block ids costs a millisecond); the used-once
        check runs every time."""
        params = request.kv_transfer_params
        if params is None or (isinstance(params, Mapping)
                              and not (params.get("do_remote_prefill") or params.get("do_remote_decode"))):
            # nothing to load or hand off (vLLM asks again after the load, both flags cleared): not parsed;
            # a prefill request's params (do_remote_decode) are, so malformed ones are refused before its hand-off
            return None
        p = self._checked.get(_request_id(request), params)
        if p is None:
            p = TransferParams.parse(params)
            if p is None or not p.do_remote_prefill:
                return None
            if self.config.kv_role == "kv_producer":
                raise InvalidArgument("this engine's kv_role is kv_producer: it loads no KV from other engines; "
                                      "send do_remote_prefill requests to a kv_consumer or kv_both engine")
            if p.remote_block_ids and (why := self._problem(p) or self._prompt_problem(request, p)):
                raise InvalidArgument(f"request {request.request_id!r}: {why}")
            self._checked.put(request.request_id, params, p)
        if p.remote_block_ids and (why := self._spent_problem(p)):
            raise InvalidArgument(f"request {request.request_id!r}: {why}")
        return p

    def _problem(self, p: TransferParams) -> str | None:
        """Why the blocks ``p`` names must not be read (or released) on its
        say-so, whoever carries it (``_spent_problem``: whether it was used)."""
        return p.source_problem(self._secret) or tp_problem(self.config.kv, p.tp_size, self.config.tp_size)

    def _prompt_digest(self, request: Request) -> str | None:
        identity = self._identity(request)
        return None if identity is None else hashlib.blake2b(identity, digest_size=16, person=b"kvt-prompt").hexdigest()

    def _prompt_problem(self, request: Request, p: TransferParams) -> str | None:
        """Why ``request`` must not read what ``p`` names: the prefill engine
        handed it off for another prompt.  (Signed with ``auth_key``, the
        digest cannot be dropped or changed; without one, clients are trusted
        and this only catches a router's mix-up.)"""
        ours = self._prompt_digest(request)
        if p.prompt_digest == ours:
            return None
        if p.prompt_digest is None:  # else a prefill engine that binds nothing turns the check off unseen
            return ("its kv_transfer_params name no prompt (the prefill engine's request had no prompt_token_ids) "
                    "and this request has one: give the prefill engine's requests their prompt_token_ids")
        return ("its kv_transfer_params were handed off for another prompt (prompt_digest differs): the decode "
                "request must carry the prompt the prefill engine computed (and its adapter and inputs)")

    def _spent_problem(self, p: TransferParams) -> str | None:
        if user := self._spent.user((p.remote_engine_id, p.remote_request_id)):
            return (f"its kv_transfer_params (prefill request {p.remote_request_id!r} of {p.remote_engine_id!r}) "
                    f"were used already, by request {user!r}; the prefill engine frees those blocks after one "
                    "read: hand each prefill's params to one decode request")
        return None

    def _end_block(self, request: Request, p: TransferParams) -> int:
        """Blocks that come from the prefill side: the prompt's whole blocks."""
        return min(_count(request.num_prompt_tokens, "request.num_prompt_tokens") // self.config.kv.block_size,
                   len(p.remote_block_ids))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the prefill side provides,
        and whether they load asynchronously (always, when there are any).
        No side effects."""
        num_computed_tokens = _count(num_computed_tokens, "num_computed_tokens")
        p = self._source(request)
        if p is None:
            return 0, False
        count = self._end_block(request, p) * self.config.kv.block_size - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """After the engine allocated ``block_ids`` (all of the request's
        blocks, in token order) for ``num_external_tokens`` tokens to load.

        Decode side: schedules the read (or, with no tokens to load — a full
        prefix hit — only the notification that lets the prefill side free).
        Prefill side with host staging: schedules the device -> host copy of
        the blocks this step fills; call again, with all blocks, whenever more
        are allocated (chunked prefill).

        Params with both ``do_remote_prefill`` and ``do_remote_decode`` (a
        router that merged the original request's params into the prefill's)
        are a decode request, as in ``get_num_new_matched_tokens`` and
        ``request_finished`` (and vLLM's NixlConnector): the read is
        scheduled and ``do_remote_decode`` is cleared with
        ``do_remote_prefill``, so the request is not held as a prefill when
        it ends."""
        params, req_id = request.kv_transfer_params, request.request_id
        block_ids, num_external_tokens = _blocks(block_ids), _count(num_external_tokens, "num_external_tokens")
        if isinstance(params, Mapping) and not params.get("do_remote_prefill") and params.get("do_remote_decode"):
            req_id = _request_id(request)
            if self.config.kv_role == "kv_consumer":  # held for nobody: its blocks would wait out the timeout
                log.warning("request %s asks to be held for a decode engine (do_remote_decode), but this engine's "
                            "kv_role is kv_consumer: it runs as a plain request (fix the router)", req_id[:80])
                params["do_remote_decode"] = False
                return
            if self.config.staging and len(block_ids):
                self._stage(req_id, _id_array(block_ids).astype(np.int64, copy=False))
            return
        p = self._source(request)
        if p is None:
            return
        end = self._end_block(request, p)
        start = end - -(-max(num_external_tokens, 0) // self.config.kv.block_size)  # ceil: a partial block is re-read
        # nothing to load (a prefix hit, or vLLM computing it itself, e.g. for
        # prompt_logprobs, chunk by chunk): no blocks needed, only the notification
        if start < end and (len(block_ids) < end or start < 0):
            raise InvalidArgument(f"request {request.request_id!r}: {num_external_tokens} tokens to load need "
                                  f"blocks {max(start, 0)}..{end - 1}, got {len(block_ids)} blocks")
        local = _ids(block_ids[start:end]) if p.remote_block_ids else []  # refused before anything changes
        self._checked.discard(req_id)  # scheduled: asked no more
        params["do_remote_prefill"] = False  # one transfer per request
        if params.get("do_remote_decode"):
            params["do_remote_decode"] = False  # a decode request (see above), never held as a prefill
        if p.remote_block_ids:
            self._recv(req_id, p, local, p.remote_block_ids[start:end])

    def _stage(self, req_id: str, ids: np.ndarray) -> None:
        """Host staging: save the blocks of ``ids`` this step fills.  Blocks
        saved before stay as they were, except the last one, which may have
        grown; a request resumed after preemption has new blocks from the
        first that differs (the ones before it are prefix-cache hits)."""
        before = self._saved.get(req_id)
        pending = self._to_save.get(req_id, [])
        if before is None:
            start = 0
        else:
            n = min(len(before), len(ids))
            differ = np.flatnonzero(before[:n] != ids[:n])
            if len(differ):  # preempted: its old blocks may be another request's by now
                start, pending = int(differ[0]), []
            else:
                start = max(len(before) - 1, 0)
        self._to_save[req_id] = list(dict.fromkeys([*pending, *ids[start:].tolist()]))
        self._saved[req_id] = ids

    def _recv(self, req_id: str, p: TransferParams, local: list[int], remote: list[int]) -> None:
        until = p.expires_at if p.expires_at is not None else time.time() + self.config.abort_request_timeout
        self._spent.add((p.remote_engine_id, p.remote_request_id), until, req_id)
        self._to_recv[req_id] = RecvRequest(local_block_ids=local, remote=RemoteSource(
            engine_id=p.remote_engine_id, request_id=p.remote_request_id, block_ids=remote,
            endpoints=p.endpoints(), tp_size=p.tp_size, expires_at=p.expires_at, agents=p.remote_agents))
        if local:
            self._loading.add(req_id)

    def update_connector_output(self, finished_sending: Iterable[str], finished_recving: Iterable[str]) -> None:
        """The requests every worker reported finished this step."""
        self._loading.difference_update(finished_recving)

    # -- every step -----------------------------------------------------------

    def build_connector_meta(self) -> ConnectorMetadata:
        """This step's work for the workers; resets it."""
        meta = ConnectorMetadata(reqs_to_recv=self._to_recv, reqs_to_save=self._to_save, reqs_to_send=self._to_send)
        self._to_recv, self._to_save, self._to_send = {}, {}, {}
        return meta

    # -- end of a request -----------------------------------------------------

    def request_finished(self, request: Request, block_ids: Sequence[int], *,
                         aborted: bool = False) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a request that ended.

        Prefill side: hold the blocks for the decode side (until it has read
        them or ``abort_request_timeout`` passes) and return where to read
        them; an aborted request, or one without a whole block, is freed now.
        Decode side: ``delay_free`` while a read still writes into the blocks;
        a request that ends before its read was scheduled tells the prefill
        side to free now."""
        req_id, params = request.request_id, request.kv_transfer_params
        if not isinstance(params, Mapping) or not params:  # (malformed ones were refused when scheduled)
            return False, None
        if params.get("do_remote_prefill") or params.get("do_remote_decode"):
            try:
                req_id = _request_id(request)
            except InvalidArgument as e:
                log.warning("%s", e)
                return False, None
        checked = self._checked.pop(req_id, params)
        if params.get("do_remote_prefill"):  # decode side, never scheduled (wins over do_remote_decode)
            params["do_remote_prefill"] = False
            if params.get("do_remote_decode"):
                params["do_remote_decode"] = False
            p = checked
            if p is None:
                try:
                    p = TransferParams.parse(params)
                except InvalidArgument:
                    return False, None  # nothing we could have read, nobody to tell
                if p.remote_block_ids and (self._problem(p) or self._prompt_problem(request, p)):
                    return False, None
            if p.remote_block_ids and not self._spent_problem(p):
                self._recv(req_id, p, [], [])
            return False, None
        if req_id in self._loading:
            return True, None
        if not params.get("do_remote_decode"):
            return False, None
        full = 0 if aborted else min(_count(request.num_prompt_tokens, "request.num_prompt_tokens")
                                     // self.config.kv.block_size, len(_blocks(block_ids)))
        if full and len(self._agents) != self.config.tp_size:
            raise InvalidArgument("the prefill scheduler does not know its workers yet: call set_worker_endpoints"
                                  "(endpoints, agents) with each worker's register_kv_caches() and agent.name "
                                  "before handing requests off")
        ids = _ids(block_ids[:full])  # refused before anything changes
        self._saved.pop(req_id, None)
        if aborted:
            self._to_save.pop(req_id, None)
            return False, None
        expires_at = time.time() + self.config.abort_request_timeout if full else None
        digest = None
        if full:
            self._to_send[req_id] = expires_at
            digest = self._prompt_digest(request)
            if digest is None and not self._warned_unbound:
                self._warned_unbound = True
                log.warning("request %s has no prompt_token_ids (prompt embeddings?): its kv_transfer_params name "
                            "no prompt, and decode engines refuse them for requests that have prompt token ids "
                            "(logged once)", req_id[:80])
        out = TransferParams(
            do_remote_prefill=True, remote_block_ids=ids, remote_engine_id=self.config.engine_id,
            remote_request_id=req_id, remote_host=self.config.side_channel_host,
            remote_port=self.config.side_channel_port or None, tp_size=self.config.tp_size,
            remote_endpoints=list(self._endpoints), remote_agents=list(self._agents), expires_at=expires_at,
            prompt_digest=digest)
        return bool(full), out.sign(self._secret if full else None).to_dict()

    def outstanding(self) -> dict[str, int]:
        """Work not yet handed to workers, and reads in flight."""
        return {"to_recv": len(self._to_recv), "to_save": len(self._to_save), "to_send": len(self._to_send),
                "loading": len(self._loading), "saving": len(self._saved)}


class FinishedAggregator:
    """Combines every worker's ``get_finished``: a request is finished for the
    engine once all ``world_size`` workers have reported it."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()

    def update(self, per_worker: Iterable[tuple[Iterable[str], Iterable[str]]]) -> tuple[set[str], set[str]]:
        done: tuple[set[str], set[str]] = (set(), set())
        for sending, recving in per_worker:
            for counts, ids, out in ((self._sending, sending, done[0]), (self._recving, recving, done[1])):
                for req_id in ids:
                    counts[req_id] += 1
                    if counts[req_id] == self.world_size:
                        del counts[req_id]
                        out.add(req_id)
        return done

    def __len__(self) -> int:
        return len(self._sending) + len(self._recving)
