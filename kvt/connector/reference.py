"""A small disaggregated engine built on ``kvt.connector``: the reference the
tests and ``kvt demo --engine`` run.

Two engines — prefill and decode — each a scheduler loop (here, in the
calling process) plus one worker process per TP rank, or at tp=1 optionally
the worker in the scheduler's process (``EngineSpec.in_process``, as vLLM
runs tp=1).  Workers hold toy KV caches whose contents are a known function
of (request, layer, K/V, global head, token, dim), so any decode rank can
check any block it holds whatever the TP ratio.  Requests flow::

    prefill: allocate -> compute every block -> request_finished -> hold
    router:  kv_transfer_params -> decode (maybe late, corrupted or never)
    decode:  get_num_new_matched_tokens -> allocate -> update_state_after_alloc
             -> load (workers) -> compute the tail -> verify every block -> free

A ``RequestSpec`` can also abort, hit the decode side's prefix cache, or
kill the prefill workers, so the tests drive every failure path through the
same loop.  Worker processes fork from a forkserver that preloads torch and
kvt (not any backend plugin), so starting them is cheap and each loads only
the backend it runs.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import select
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgument, KvtError, KvtTimeoutError
from .config import ConnectorConfig, KVCacheSpec
from .metadata import ConnectorMetadata
from .scheduler import ConnectorScheduler, EngineRequest, FinishedAggregator

__all__ = ["ToyModel", "EngineSpec", "RequestSpec", "RequestResult", "Report", "run_pd", "toy_kv",
           "mixed_requests"]

_PRIMES = {"float16": 2039, "bfloat16": 251, "float32": 16777213}  # integers each dtype holds exactly
_REPLY_TIMEOUT = 60.0  # seconds a worker may take to answer one step
# The scheduler busy-polls for a step's replies this long before it blocks, as
# vLLM's multiprocess executor busy-polls its response queue: a reply that lands
# while the scheduler sleeps waits for its wake-up, on a VM 150-290 us when the
# CPU it sleeps on has halted (docs/performance.md).  It yields while it polls,
# so the workers it waits for keep the CPUs.
_REPLY_SPIN = 0.005


@dataclass(frozen=True)
class ToyModel:
    """The KV cache shape of the toy model."""

    layers: int = 2
    kv_heads: int = 4
    head_dim: int = 8
    block_size: int = 4
    dtype: str = "float16"
    kv_layout: str = "split"  # split | joined | packed | mla
    head_layout: str = "HND"
    name: str = "toy"

    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(model=self.name, num_layers=self.layers, num_kv_heads=1 if self.kv_layout == "mla"
                           else self.kv_heads, head_dim=self.head_dim * (2 if self.kv_layout == "packed" else 1),
                           dtype=self.dtype,
                           block_size=self.block_size, kv_layout=self.kv_layout, head_layout=self.head_layout)


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    model: ToyModel = ToyModel()
    tp: int = 1
    num_blocks: int = 128
    backend: str = "host"
    backend_options: dict = field(default_factory=dict)
    staging: bool = False  #: kv_buffer_device="cpu": caches are private "device" memory behind host buffers
    #: tp=1 only: the worker runs in the scheduler's process (vLLM's single-process executor), not in
    #: a process of its own; it sets torch's threads to 1 in that process, as worker processes do, and
    #: takes each step's ConnectorMetadata as the object (vLLM's executor passes it so), not encoded
    in_process: bool = False
    abort_request_timeout: float = 30.0
    expiry_margin: float = 0.2
    handshake_timeout: float = 2.0
    transfer_timeout: float = 10.0

    def connector_config(self) -> ConnectorConfig:
        return ConnectorConfig(
            engine_id=self.engine_id, kv=self.model.spec(), tp_size=self.tp, backend=self.backend,
            backend_options=dict(self.backend_options), kv_buffer_device="cpu" if self.staging else None,
            abort_request_timeout=self.abort_request_timeout, expiry_margin=self.expiry_margin,
            handshake_timeout=self.handshake_timeout, transfer_timeout=self.transfer_timeout)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_len: int
    prefix_hit_blocks: int = 0          #: the decode side already holds this many blocks
    abort: str | None = None            #: "prefill" | "decode_waiting" | "decode_loading"
    handoff_delay: float = 0.0          #: seconds the router sits on the params
    drop: bool = False                  #: the router never delivers the params
    params_override: dict | None = None  #: the router corrupts the params
    kill_prefill: bool = False          #: prefill workers die right after this hand-off
    barrier: bool = False               #: admitted only once every earlier request finished


@dataclass
class RequestResult:
    request_id: str
    status: str = "pending"  # ok | failed | aborted | dropped
    latency: float = 0.0     #: prefill admission -> decode verified
    load_latency: float = 0.0  #: decode side: read scheduled -> reported loaded
    loaded_blocks: int = 0   #: blocks read from the prefill side
    mismatches: int = 0      #: elements that differ from the expected contents
    reason: str = ""


@dataclass
class Report:
    results: dict[str, RequestResult]
    elapsed: float
    workers: dict[str, list[dict]]   #: engine id -> per-rank {"outstanding", "stats", "timings", "pid", ...}
    leaks: dict[str, Any]            #: everything still held at the end (empty when nothing leaked)

    @property
    def bytes_moved(self) -> int:
        return sum(w["stats"]["bytes_read"] for ws in self.workers.values() for w in ws)


# -- toy contents ----------------------------------------------------------------


def _canonical(t, model: ToyModel):
    """A view of one layer's cache as (num_blocks, parts, heads, block_size, head_dim)."""
    if model.kv_layout == "mla":
        return t.unsqueeze(1).unsqueeze(2)
    if model.kv_layout == "packed":  # K|V in the last dim: (blocks, heads|size, size|heads, 2 * head_dim)
        v = t.unflatten(-1, (2, model.head_dim)).permute(0, 3, 1, 2, 4)
        return v.transpose(2, 3) if model.head_layout == "NHD" else v
    v = t.transpose(0, 1) if model.kv_layout == "split" else t
    return v.transpose(2, 3) if model.head_layout == "NHD" else v


def toy_kv(model: ToyModel, tp_size: int, tp_rank: int, key: int, first_block: int, n_blocks: int):
    """Expected contents of blocks ``first_block ..`` of request ``key`` on a
    rank: ``(layers, n_blocks, parts, heads, block_size, head_dim)``."""
    import torch

    mla = model.kv_layout == "mla"
    parts, heads = (1, 1) if mla else (2, model.kv_heads // tp_size)
    head0, prime = 0 if mla else tp_rank * heads, _PRIMES[model.dtype]
    # (per layer, part, head) + (per token, dim), each already reduced, then one conditional subtract
    work = np.float32 if prime < 2**23 else np.int64  # exact for sums below 2 * prime
    l, p, h = np.ix_(np.arange(model.layers), np.arange(parts), np.arange(heads))
    base = ((key * 1009 + l * 613 + p * 877 + (head0 + h) * 131) % prime).astype(work)
    bs, hd = model.block_size, model.head_dim
    token = first_block * bs + np.arange(n_blocks * bs).reshape(n_blocks, bs, 1)
    tok = ((token * 17 + np.arange(hd)) % prime).astype(work)
    vals = base.reshape(model.layers, 1, parts, heads, 1, 1) + tok.reshape(1, n_blocks, 1, 1, bs, hd)
    vals -= (vals >= prime) * work(prime)
    return torch.from_numpy(vals).to(getattr(torch, model.dtype))


def _caches(spec: EngineSpec, rank: int) -> dict:
    import torch

    from ..memory import empty_tensor

    m, cfg = spec.model, spec.connector_config()
    block = cfg.kv.block_shape(spec.tp)
    shape = {"split": (2, spec.num_blocks, *block), "joined": (spec.num_blocks, 2, *block),
             "packed": (spec.num_blocks, *block), "mla": (spec.num_blocks, *block)}[m.kv_layout]
    dtype = getattr(torch, m.dtype)
    # staging: a private buffer stands in for device memory; otherwise kvt shared memory, zeroed
    # like an engine's cache at start-up (else the first loads into a block pay its page faults)
    alloc = (lambda: torch.zeros(shape, dtype=dtype)) if spec.staging else (lambda: empty_tensor(shape, dtype).zero_())
    return {f"layers.{i}.attn": alloc() for i in range(m.layers)}


# -- worker process -------------------------------------------------------------


def _step(worker, caches: list, spec: EngineSpec, rank: int, work: dict) -> dict:
    import torch

    m = spec.model
    meta = work["meta"]  # encoded for a worker process; in-process, the scheduler's object
    worker.start_load_kv(meta if isinstance(meta, ConnectorMetadata) else ConnectorMetadata.decode(meta))
    for key, ids, first in work["compute"]:  # the "forward pass": write this rank's KV
        vals, idx = toy_kv(m, spec.tp, rank, key, first, len(ids)), torch.as_tensor(ids, dtype=torch.long)
        for layer, t in enumerate(caches):
            _canonical(t, m)[idx] = vals[layer]
    worker.wait_for_save()
    mismatches = {}
    for req_id, key, ids in work["verify"]:
        want, idx = toy_kv(m, spec.tp, rank, key, 0, len(ids)), torch.as_tensor(ids, dtype=torch.long)
        got = [_canonical(t, m)[idx] for t in caches]
        mismatches[req_id] = sum(0 if torch.equal(g, w) else int((g != w).sum()) for g, w in zip(got, want))
    sending, recving = worker.get_finished()
    return {"sending": sending, "recving": recving, "invalid": worker.get_block_ids_with_load_errors(),
            "failures": worker.failure_reasons(), "mismatches": mismatches}


def _kvt_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("KVT_")}


class _Rank:
    """One TP rank: its toy caches and connector worker, answering the
    engine's ``(command, work)`` messages with ``(kind, value)`` replies."""

    def __init__(self, spec: EngineSpec, rank: int):
        from .worker import ConnectorWorker

        import torch

        # the toy forward pass is a few indexing ops: one thread does it, and no
        # OpenMP pool is left spin-waiting after each op on CPUs the other engine's
        # copies need (both engines share this machine)
        torch.set_num_threads(1)
        self.spec, self.rank = spec, rank
        caches = _caches(spec, rank)
        self.worker = ConnectorWorker(spec.connector_config(), rank)
        try:
            self.ready = ("ready", (self.worker.register_kv_caches(caches), self.worker.agent.name))
        except BaseException:
            self.worker.shutdown()
            raise
        self.layers = list(caches.values())

    def answer(self, cmd: str, work) -> tuple:
        if cmd == "stop":
            w = self.worker
            report = {"outstanding": w.outstanding(), "stats": dict(w.stats), "timings": w.take_timings(),
                      "config": w.agent.config.shown(), "pid": os.getpid()}
            w.shutdown()
            return "ok", report
        return "ok", _step(self.worker, self.layers, self.spec, self.rank, work)


def _worker_main(spec: EngineSpec, rank: int, conn, env: dict[str, str]) -> None:
    # kvt's settings as the engine has them now: a forkserver child inherits the environment the
    # server started with (possibly another engine's, earlier), not the engine's
    for k in _kvt_environment().keys() - env.keys():
        del os.environ[k]
    os.environ.update(env)
    rank_, conn = None, _Pipe(conn)
    try:
        rank_ = _Rank(spec, rank)
        conn.send(rank_.ready)
        while conn.poll(_REPLY_TIMEOUT * 5):  # no word from the engine for that long: it is gone
            cmd, work = conn.recv()
            conn.send(rank_.answer(cmd, work))
            if cmd == "stop":
                return
    except BaseException:
        conn.send(("error", f"{spec.engine_id} rank {rank}: {traceback.format_exc()}"))
    finally:
        if rank_ is not None:
            rank_.worker.shutdown()


class _InProcessRank:
    """A rank in the engine's own process, behind the same send/poll/recv as
    a worker process's pipe: vLLM's single-process executor (tp=1)."""

    def __init__(self, spec: EngineSpec, rank: int):
        self._out: deque = deque()
        self._name = f"{spec.engine_id} rank {rank}"
        self._rank = self._run(lambda: _Rank(spec, rank))
        if self._rank is not None:
            self._out.append(self._rank.ready)

    def _run(self, fn):
        """``fn()``, or None with the error a worker process would have sent queued."""
        try:
            return fn()
        except Exception:  # noqa: BLE001
            self._out.append(("error", f"{self._name}: {traceback.format_exc()}"))
            return None

    def send(self, msg: tuple) -> None:
        if self._rank is None:
            self._out.append(("error", f"{self._name} never started"))
        elif (reply := self._run(lambda: self._rank.answer(*msg))) is not None:
            self._out.append(reply)

    def poll(self, timeout: float) -> bool:
        return bool(self._out)

    def recv(self) -> tuple:
        return self._out.popleft()

    def close(self) -> None:
        if self._rank is not None:
            self._rank.worker.shutdown()


class _Pipe:
    """One end of a worker's pipe, messages pickled with plain ``pickle``:
    multiprocessing's pickler copies a dispatch table per message, and its
    ``poll`` builds a selector per call, tens of microseconds each once a
    copy has left the caches cold."""

    def __init__(self, conn):
        self._conn, self._poller = conn, select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def send(self, msg: tuple) -> None:
        self._conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))

    def poll(self, timeout: float) -> bool:
        return bool(self._poller.poll(math.ceil(timeout * 1000)))

    def recv(self) -> tuple:
        return pickle.loads(self._conn.recv_bytes())

    def close(self) -> None:
        self._conn.close()


def _await(conn, timeout: float) -> bool:
    """Whether ``conn`` has a message within ``timeout`` s: polled for up to
    ``_REPLY_SPIN`` s, then waited on."""
    end = time.perf_counter() + _REPLY_SPIN
    while not conn.poll(0):
        if time.perf_counter() > end:
            return conn.poll(timeout)
        os.sched_yield()
    return True


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "kvt.connector.worker", __name__])
    return ctx


# -- engine (scheduler side) -----------------------------------------------------


class _BlockPool:
    def __init__(self, n: int, seed: int):
        self.size = n
        self._free = list(np.random.default_rng(seed).permutation(n).tolist())  # non-contiguous ids

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out, self._free = self._free[-n:] if n else [], self._free[:len(self._free) - n]
        return out

    def free(self, ids) -> None:
        self._free.extend(ids)

    @property
    def used(self) -> int:
        return self.size - len(self._free)


class _Engine:
    """One engine: its connector scheduler, block pool and worker processes."""

    def __init__(self, spec: EngineSpec, ctx):
        self.spec, self.alive = spec, True
        self.sched = ConnectorScheduler(spec.connector_config())
        self.agg = FinishedAggregator(spec.tp)
        self.pool = _BlockPool(spec.num_blocks, seed=hash(spec.engine_id) & 0xFFFF)
        self.conns, self.procs = [], []
        if spec.in_process:
            self.conns.append(_InProcessRank(spec, 0))
            return
        for rank in range(spec.tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(spec, rank, child, _kvt_environment()),
                            name=f"{spec.engine_id}-tp{rank}", daemon=True)
            p.start()
            child.close()
            self.conns.append(_Pipe(parent))
            self.procs.append(p)

    def start(self) -> None:
        ready = self._gather("ready")  # (endpoint, agent name) of each rank
        self.sched.set_worker_endpoints({r: e for r, (e, _) in enumerate(ready)},
                                        {r: name for r, (_, name) in enumerate(ready)})

    def _gather(self, want: str = "ok") -> list:
        out = []
        for rank, conn in enumerate(self.conns):
            if not _await(conn, _REPLY_TIMEOUT):
                raise KvtTimeoutError(f"{self.spec.engine_id} rank {rank} did not answer within {_REPLY_TIMEOUT:g}s")
            try:
                kind, value = conn.recv()
            except EOFError:
                code = self.procs[rank].exitcode
                raise KvtError(f"{self.spec.engine_id} rank {rank} died (exit code {code})") from None
            if kind == "error":
                raise KvtError(value)
            out.append(value)
        return out

    def step(self, compute=(), verify=()) -> dict:
        meta = self.sched.build_connector_meta()
        work = {"meta": meta if self.spec.in_process else meta.encode(), "compute": list(compute),
                "verify": list(verify)}
        for conn in self.conns:
            conn.send(("step", work))
        outs = self._gather()
        sending, recving = self.agg.update((o["sending"], o["recving"]) for o in outs)
        self.sched.update_connector_output(sending, recving)
        mism: dict[str, int] = {}
        for o in outs:
            for req_id, n in o["mismatches"].items():
                mism[req_id] = mism.get(req_id, 0) + n
        return {"sending": sending, "recving": recving, "invalid": set().union(*(o["invalid"] for o in outs)),
                "failures": {k: v for o in outs for k, v in o["failures"].items()}, "mismatches": mism}

    def kill(self) -> None:
        self.alive = False
        for p in self.procs:
            p.kill()
            p.join(10)  # reap it, so peers see it gone rather than a zombie

    def close(self, strict: bool = True) -> list[dict]:
        """Stop the workers; their final reports.  ``strict=False`` (cleanup
        after an error) swallows a worker that cannot answer any more."""
        reports = []
        if self.alive:
            self.alive = False
            try:
                for conn in self.conns:
                    conn.send(("stop", None))
                reports = self._gather()
            except (OSError, KvtError):
                if strict:
                    raise
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        return reports


# -- the driver ------------------------------------------------------------------


def _blocks(n_tokens: int, bs: int) -> int:
    return -(-n_tokens // bs)


class _Run:
    """The scheduler loops of both engines plus the router between them."""

    def __init__(self, prefill: _Engine, decode: _Engine, requests: list[RequestSpec]):
        self.p, self.d = prefill, decode
        self.bs = decode.spec.model.block_size
        self.specs = {r.request_id: r for r in requests}
        self.keys = {r.request_id: i + 1 for i, r in enumerate(requests)}
        self.results = {r.request_id: RequestResult(r.request_id) for r in requests}
        self.queue = deque(requests)
        self.started: dict[str, float] = {}
        self.held: dict[str, list[int]] = {}                     # prefill blocks held for readers
        self.router: list[tuple[float, str, dict]] = []          # (deliver at, request, params)
        self.loading: dict[str, tuple[EngineRequest, list[int], int]] = {}  # -> loaded up to block n
        self.ready: dict[str, tuple[EngineRequest, list[int], int]] = {}  # -> compute tail from block n
        self.aborting: set[str] = set()                          # decode requests aborted mid-load
        self.load_start: dict[str, float] = {}

    def done(self) -> bool:
        pending = any(r.status == "pending" for r in self.results.values())
        return not (pending or self.held or self.router or self.loading or self.ready
                    or (self.p.alive and len(self.p.agg)) or len(self.d.agg))

    def _finish(self, req_id: str, status: str, reason: str = "") -> None:
        res = self.results[req_id]
        res.status, res.reason = status, reason
        res.latency = time.perf_counter() - self.started.get(req_id, time.perf_counter())

    # prefill engine: admit, compute, finish (one step per request: no chunking)
    def prefill_step(self) -> None:
        if not self.p.alive:
            while self.queue:
                self._finish(self.queue.popleft().request_id, "failed", "the prefill engine is gone")
            return
        admitted, compute = [], []
        while self.queue:
            spec = self.queue[0]
            if spec.barrier and any(r.status == "pending" for r in self.results.values()
                                    if r.request_id in self.started):
                break
            ids = self.p.pool.alloc(_blocks(spec.prompt_len, self.bs))
            if ids is None:
                break  # wait for held blocks to be freed
            self.queue.popleft()
            req = EngineRequest(spec.request_id, spec.prompt_len, {"do_remote_decode": True}, self._tokens(spec))
            self.started[spec.request_id] = time.perf_counter()
            self.p.sched.update_state_after_alloc(req, ids, 0)
            admitted.append((spec, req, ids))
            compute.append((self.keys[spec.request_id], ids, 0))
        out = self.p.step(compute)
        for req_id in out["sending"]:
            self.p.pool.free(self.held.pop(req_id))
        for spec, req, ids in admitted:
            aborted = spec.abort == "prefill"
            delay, params = self.p.sched.request_finished(req, ids, aborted=aborted)
            if delay:
                self.held[spec.request_id] = ids
            else:
                self.p.pool.free(ids)
            if aborted:
                self._finish(spec.request_id, "aborted", "aborted during prefill")
            elif spec.drop:
                self._finish(spec.request_id, "dropped", "the router never delivered the params")
            else:
                params = {**params, **(spec.params_override or {})}
                self.router.append((time.perf_counter() + spec.handoff_delay, spec.request_id, params))
            if spec.kill_prefill:
                self.p.kill()
                self.held.clear()  # the dead engine's memory is gone with it
                return

    # decode engine: admit what the router delivered, load, compute the tail, verify
    def decode_step(self) -> None:
        now, compute, verify = time.perf_counter(), [], []
        for item in [x for x in self.router if x[0] <= now]:
            if self._admit(item[1], item[2], compute):
                self.router.remove(item)
        for req_id, (req, ids, first) in self.ready.items():
            compute.append((self.keys[req_id], ids[first:], first))
            verify.append((req_id, self.keys[req_id], ids))
        verifying, self.ready = self.ready, {}
        out = self.d.step(compute, verify)
        for req_id, (req, ids, first) in verifying.items():
            mism = out["mismatches"][req_id]
            self.results[req_id].mismatches = mism
            self.results[req_id].loaded_blocks = first - self._prefix(self.specs[req_id])
            self._release(req, ids)
            self._finish(req_id, "ok" if mism == 0 else "failed", "" if mism == 0 else f"{mism} elements differ")
        for req_id in out["recving"]:
            req, ids, end = self.loading.pop(req_id)
            self.results[req_id].load_latency = time.perf_counter() - self.load_start.pop(req_id)
            bad = out["invalid"].intersection(ids)
            if req_id in self.aborting:
                self.aborting.discard(req_id)
                self.d.pool.free(ids)
                self._finish(req_id, "aborted", "aborted while loading")
            elif bad:
                self._release(req, ids)
                self._finish(req_id, "failed", out["failures"].get(req_id, f"{len(bad)} blocks failed to load"))
            else:
                self.ready[req_id] = (req, ids, end)

    def _admit(self, req_id: str, params: dict, compute: list) -> bool:
        """Schedule a delivered request; False to retry when blocks free up."""
        spec = self.specs[req_id]
        req = EngineRequest(req_id, spec.prompt_len, params, self._tokens(spec))
        if spec.abort == "decode_waiting":
            self.d.sched.request_finished(req, [], aborted=True)
            self._finish(req_id, "aborted", "aborted before it was scheduled")
            return True
        prefix = self._prefix(spec)
        try:
            n, load = self.d.sched.get_num_new_matched_tokens(req, prefix * self.bs)
        except KvtError as e:
            self._finish(req_id, "failed", f"{type(e).__name__}: {e}")
            return True
        ids = self.d.pool.alloc(_blocks(spec.prompt_len, self.bs))
        if ids is None:
            return False
        self.d.sched.update_state_after_alloc(req, ids, n)
        if prefix:
            compute.append((self.keys[req_id], ids[:prefix], 0))  # its prefix-cache hit
        if load:
            self.load_start[req_id] = time.perf_counter()
            self.loading[req_id] = (req, ids, min(spec.prompt_len // self.bs, len(params["remote_block_ids"])))
            if spec.abort == "decode_loading":
                delay, _ = self.d.sched.request_finished(req, ids, aborted=True)
                if not delay:
                    raise KvtError(f"{req_id} aborted mid-load: its blocks must be kept until the load settles")
                self.aborting.add(req_id)
        else:
            self.ready[req_id] = (req, ids, prefix)
        return True

    def _tokens(self, spec: RequestSpec) -> np.ndarray:
        """The request's prompt, as both engines see it (its toy KV's key picks it)."""
        return np.arange(spec.prompt_len, dtype=np.int64) * 7 + self.keys[spec.request_id]

    def _prefix(self, spec: RequestSpec) -> int:
        """Blocks of the prompt already in the decode side's prefix cache."""
        return min(spec.prefix_hit_blocks, spec.prompt_len // self.bs)

    def _release(self, req, ids) -> None:
        delay, _ = self.d.sched.request_finished(req, ids)
        if delay:
            raise KvtError(f"decode request {req.request_id} still loading after it was reported loaded")
        self.d.pool.free(ids)


def run_pd(prefill: EngineSpec, decode: EngineSpec, requests: list[RequestSpec], *,
           timeout: float = 120.0, poll: float = 0.001) -> Report:
    """Run ``requests`` through a prefill and a decode engine; returns what
    happened to each, what the workers did, and anything left held."""
    for e in (prefill, decode):
        if e.in_process and e.tp != 1:
            raise InvalidArgument(f"engine {e.engine_id!r}: in_process needs tp=1, not {e.tp}")
    if prefill.in_process and any(r.kill_prefill for r in requests):
        raise InvalidArgument("kill_prefill kills the prefill engine's worker processes; it has none in_process")
    for spec, e in ((s, e) for s in requests for e in (prefill, decode)):
        need = _blocks(spec.prompt_len, e.model.block_size)
        if need > e.num_blocks:
            raise InvalidArgument(f"request {spec.request_id!r} needs {need} blocks, engine {e.engine_id!r} "
                                  f"has {e.num_blocks}; raise num_blocks")
    ctx = _context()
    engines: list[_Engine] = []
    t0 = time.perf_counter()
    try:
        engines = [_Engine(prefill, ctx), _Engine(decode, ctx)]
        for e in engines:
            e.start()
        run = _Run(*engines, requests)
        t0 = time.perf_counter()
        deadline = t0 + timeout
        while not run.done():
            if time.perf_counter() > deadline:
                pending = {k: v.status for k, v in run.results.items() if v.status == "pending"}
                raise KvtTimeoutError(f"reference engine did not settle within {timeout:g}s: pending {pending}, "
                                      f"held {sorted(run.held)}, loading {sorted(run.loading)}")
            run.prefill_step()
            run.decode_step()
            if not (run.loading or run.ready):  # an engine steps back to back while reads are in flight
                time.sleep(poll)
        elapsed = time.perf_counter() - t0
        workers, leaks = {}, {}
        for e in engines:
            was_alive = e.alive
            workers[e.spec.engine_id] = reports = e.close()
            if not was_alive:
                continue
            for rank, r in enumerate(reports):
                held = {k: v for k, v in r["outstanding"].items() if v}
                if held:
                    leaks[f"{e.spec.engine_id} rank {rank}"] = held
            if e.pool.used:
                leaks[f"{e.spec.engine_id} blocks"] = e.pool.used
            if any(e.sched.outstanding().values()):
                leaks[f"{e.spec.engine_id} scheduler"] = e.sched.outstanding()
        return Report(run.results, elapsed, workers, leaks)
    finally:
        for e in engines:
            e.close(strict=False)


def mixed_requests(n: int, block_size: int, max_blocks: int, seed: int = 0) -> list[RequestSpec]:
    """``n`` requests of mixed lengths: some shorter than a block, some
    ending mid-block, some many blocks long."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_blocks * block_size + 1, size=n)
    if block_size > 1:
        lens[: max(1, n // 8)] = rng.integers(1, block_size, size=max(1, n // 8))  # shorter than one block
    return [RequestSpec(f"req-{i}", int(x)) for i, x in enumerate(lens)]


def summary(report: Report) -> dict[str, Any]:
    """JSON-friendly view of a report."""
    return {"elapsed_s": report.elapsed, "bytes_moved": report.bytes_moved, "leaks": report.leaks,
            "results": [asdict(r) for r in report.results.values()], "workers": report.workers}
