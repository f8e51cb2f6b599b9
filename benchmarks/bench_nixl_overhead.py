"""kvt's nixl backend next to the same operations written directly against
``nixl_agent``: how much does kvt cost?

    python benchmarks/bench_nixl_overhead.py [--reps 15] [--lat-iters 3000] [--ucx-tls TLS]
    python benchmarks/bench_nixl_overhead.py --tls-sweep   # which UCX_TLS moves bytes fastest here

Two processes.  The target owns a 256 MiB buffer registered with a raw
``nixl_agent`` and with a kvt ``NixlBackend``; the initiator owns another,
registered with both as well.  Every case runs raw and kvt alternately on
the same buffers and the same index arrays (so machine load hits both alike)
and reports medians:

* bandwidth, 1 x 256 MiB and 4096 x 64 KiB (remote blocks in a random
  order), READ and WRITE: post, poll to DONE;  kvt/raw >= 0.97 is the target
* one 4 KiB block, post + poll to DONE (release untimed);  kvt/raw <= 1.2;
  and, as the floor under both, NIXL's pybind calls alone (``makeXferReq``,
  ``postXferReq``, ``getXferStatus`` on ``nixl_agent.agent``, the ids as the
  list kvt hands over): what is left to kvt's Python once NIXL's own time
  is paid
* the same through ``kvt.Agent`` (``transfer_blocks`` + ``Transfer.state``,
  a third agent in each process, connected through kvt's handshake): what
  issue 13's line "nixl via Agent <= 1.3x raw nixl_agent" asks, measured
  interleaved with raw in batches of 100 (this VM's speed drifts by up to
  80% within seconds: engines timed one after the other, as ``kvt bench``
  does, compare phases of the machine as much as code)
* building and prepping descriptor lists of 100,000 blocks (local + remote)

Raw uses nixl_agent's defaults and kvt the nixl backend's (both
NIXL_THREAD_SYNC_NONE; kvt serializes its own NIXL calls with a lock), except that
NIXL's progress thread is off in all four agents unless --progress-thread.  ``--tls-sweep`` instead times kvt alone under
several UCX_TLS values and both UCX error-handling modes, next to a memcpy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

SIZE = 256 << 20
SWEEP_TLS = ["default", "cma,tcp,self", "cma,self", "shm,self", "sm,self", "posix,self", "sysv,self",
             "shm,cma,self", "tcp,self", "^cma"]


def _quiet_nixl() -> Any:
    import logging

    from nixl import _api
    logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs every agent at INFO on stdout
    return _api


def _rows(addr: int, block: int, count: int) -> np.ndarray:
    """(count, 3) uint64 descriptors of consecutive blocks: what raw NIXL code builds."""
    out = np.empty((count, 3), np.uint64)
    out[:, 0] = addr + np.arange(count, dtype=np.uint64) * block
    out[:, 1], out[:, 2] = block, 0
    return out


def _target(env: dict, kvt_options: dict, with_raw: bool, conn) -> None:
    os.environ.update(env)
    thread = kvt_options.get("progress_thread", True)
    from kvt.types import Descs
    from kvt_nixl.backend import NixlBackend

    buf = np.full(SIZE, 7, np.uint8)  # touched: no page faults while timing
    raw = None
    if with_raw:
        api = _quiet_nixl()
        raw = api.nixl_agent("raw-target", api.nixl_agent_config(backends=["UCX"], enable_prog_thread=thread))
        raw.register_memory(_rows(buf.ctypes.data, SIZE, 1), "DRAM")
    kvt = NixlBackend("kvt-target", kvt_options)
    kvt.register(Descs.from_buffers([buf]))
    agent = _agent("agent-target", kvt_options, buf) if with_raw else None
    conn.send((raw.get_agent_metadata() if raw else None, kvt.local_metadata(), buf.ctypes.data,
               agent.listen() if agent else None))
    deadline = time.monotonic() + 3600
    while not conn.poll(0.001 if not thread else 1.0) and time.monotonic() < deadline:
        if not thread:  # no progress thread: progress as an engine's target would, polling notifications
            kvt.get_notifs()
            if raw:
                raw.get_new_notifs()
                agent.get_notifs()
    if agent:
        agent.close()
    kvt.close()


_RT_BLOCK, _RT_BLOCKS = 4096, 4096  # the round-trip cases' blocks: the first 16 MiB of each buffer


def _agent(name: str, kvt_options: dict, buf: np.ndarray) -> Any:
    """A ``kvt.Agent`` on the nixl backend with ``buf``'s first blocks as layout ``rt``."""
    from kvt import Agent

    agent = Agent(name, backend="nixl", options=kvt_options)
    agent.register_blocks("rt", [buf[:_RT_BLOCK * _RT_BLOCKS].reshape(_RT_BLOCKS, _RT_BLOCK)])
    return agent


class Session:
    """The initiator's side: a raw agent and a kvt backend on one local
    buffer, both loaded with the target's metadata, and (with raw) a
    ``kvt.Agent`` connected to the target's."""

    def __init__(self, env: dict, kvt_options: dict, with_raw: bool):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target, args=(env, kvt_options, with_raw, child), daemon=True)
        self._proc.start()
        try:
            self._start(env, kvt_options, with_raw)
        except BaseException:
            self._proc.kill()
            raise

    def _start(self, env: dict, kvt_options: dict, with_raw: bool) -> None:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            from kvt.types import Descs
            from kvt_nixl.backend import NixlBackend

            self.buf = np.ones(SIZE, np.uint8)
            self.raw = None
            if with_raw:
                api = _quiet_nixl()
                self.raw = api.nixl_agent("raw-initiator", api.nixl_agent_config(
                    backends=["UCX"], enable_prog_thread=kvt_options.get("progress_thread", True)))
                self.raw.register_memory(_rows(self.buf.ctypes.data, SIZE, 1), "DRAM")
            self.kvt = NixlBackend("kvt-initiator", kvt_options)
            self.kvt.register(Descs.from_buffers([self.buf]))
            self.agent = _agent("agent-initiator", kvt_options, self.buf) if with_raw else None
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if not self._conn.poll(120):
            raise TimeoutError("the target process did not start")
        raw_md, kvt_md, self.remote, endpoint = self._conn.recv()
        self.raw_peer = self.raw.add_remote_agent(raw_md).decode() if with_raw else None
        self.kvt_peer = self.kvt.add_remote(kvt_md)
        self.agent_peer = self.agent.connect(endpoint) if with_raw else None
        if with_raw:
            bind = _quiet_nixl().nixlBind
            self.nixl_ops, self.nixl_ok = {"READ": bind.NIXL_READ, "WRITE": bind.NIXL_WRITE}, bind.NIXL_SUCCESS

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join(20)
        if self._proc.is_alive():
            self._proc.kill()
        if self.agent:
            self.agent.close()
        self.kvt.close()

    # -- one list pair each, same blocks ------------------------------------------

    def raw_lists(self, block: int, count: int) -> tuple[Any, Any]:
        return (self.raw.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(self.buf.ctypes.data, block, count), "DRAM"),
                self.raw.prep_xfer_dlist(self.raw_peer, _rows(self.remote, block, count), "DRAM"))

    def kvt_lists(self, block: int, count: int) -> tuple[int, int]:
        from kvt.types import Descs
        return (self.kvt.prep(None, Descs.from_blocks(self.buf.ctypes.data, block, np.arange(count))),
                self.kvt.prep(self.kvt_peer, Descs.from_blocks(self.remote, block, np.arange(count))))

    # -- one transfer, post to DONE; returns seconds --------------------------------

    def raw_xfer(self, op: str, lists, li: np.ndarray, ri: np.ndarray) -> float:
        a = self.raw
        t = time.perf_counter()
        h = a.make_prepped_xfer(op, lists[0], li, lists[1], ri)
        s = a.transfer(h)
        while s == "PROC":
            s = a.check_xfer_state(h)
        dt = time.perf_counter() - t
        assert s == "DONE", s
        a.release_xfer_handle(h)
        return dt

    def calls_xfer(self, op: str, lists, li: list, ri: list) -> float:
        """NIXL's pybind calls alone: no wrapper, no bookkeeping."""
        a = self.raw.agent
        ok = self.nixl_ok
        t = time.perf_counter()
        h = a.makeXferReq(self.nixl_ops[op], lists[0]._handle, li, lists[1]._handle, ri, b"", [], False)
        s = a.postXferReq(h, b"")
        while s != ok:
            s = a.getXferStatus(h)
        dt = time.perf_counter() - t
        a.releaseXferReq(h)
        return dt

    def kvt_xfer(self, op: str, lists, li: np.ndarray, ri: np.ndarray) -> float:
        b = self.kvt
        t = time.perf_counter()
        h = b.transfer(op, lists[0], li, lists[1], ri)
        while (s := b.check_state(h)).pending:
            pass
        dt = time.perf_counter() - t
        assert s.done, s
        b.release(h)
        return dt

    def agent_xfer(self, op, li: np.ndarray, ri: np.ndarray) -> float:
        """What an engine's connector does: block ids of layout ``rt`` in, a ``Transfer`` polled to DONE."""
        a = self.agent
        t = time.perf_counter()
        x = a.transfer_blocks(op, self.agent_peer, li, ri, "rt")
        while (s := x.state()).pending:
            pass
        dt = time.perf_counter() - t
        assert s.done, s
        x.release()
        return dt


def _alternate(reps: int, raw: Callable[[], float], kvt: Callable[[], float], batch: int = 1) -> tuple[float, float]:
    """Medians of ``reps`` runs each after a warm-up, in batches of ``batch``
    runs, raw and kvt alternating in ABBA order (so neither always goes first)."""
    raw(), kvt()
    r: list[float] = []
    k: list[float] = []
    for i in range(max(1, reps // batch)):
        for fn, out in ((raw, r), (kvt, k)) if i % 2 == 0 else ((kvt, k), (raw, r)):
            out += [fn() for _ in range(batch)]
    return statistics.median(r), statistics.median(k)


def overhead(args) -> list[tuple[str, str, str, str, str]]:
    from kvt.types import Op

    ops = {"READ": Op.READ, "WRITE": Op.WRITE}
    s = Session({"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}, {"progress_thread": args.progress_thread}, True)
    rows = []
    try:
        rng = np.random.default_rng(0)
        for label, block, count in [("1 x 256 MiB", SIZE, 1), ("4096 x 64 KiB", 64 << 10, 4096)]:
            rl, kl = s.raw_lists(block, count), s.kvt_lists(block, count)
            li = np.arange(count, dtype=np.int32)
            ri = rng.permutation(count).astype(np.int32)  # scattered remote blocks, as in a KV cache
            for op in ("READ", "WRITE"):
                r, k = _alternate(args.reps, lambda: s.raw_xfer(op, rl, li, ri),
                                  lambda: s.kvt_xfer(ops[op], kl, li, ri))
                gb = SIZE / 1e9
                rows.append((f"bandwidth {label} {op}", f"{gb / r:.2f} GB/s", f"{gb / k:.2f} GB/s",
                             f"{r / k:.3f}", ">= 0.97"))
        rl, kl = s.raw_lists(_RT_BLOCK, _RT_BLOCKS), s.kvt_lists(_RT_BLOCK, _RT_BLOCKS)
        idx = [np.array([i], np.int32) for i in rng.integers(0, _RT_BLOCKS, 64)]
        ids = [i.astype(np.int64) for i in idx]  # block ids as an engine holds them
        lists = [i.tolist() for i in idx]
        for op in ("READ", "WRITE"):
            it = iter(range(1 << 62))
            r, k = _alternate(args.lat_iters, lambda: s.raw_xfer(op, rl, idx[next(it) % 64], idx[0]),
                              lambda: s.calls_xfer(op, rl, lists[next(it) % 64], lists[0]), batch=100)
            rows.append((f"4 KiB round trip {op}: NIXL's calls alone (the floor)", f"{r * 1e6:.2f} us",
                         f"{k * 1e6:.2f} us", f"{k / r:.3f}", "reported"))
            r, k = _alternate(args.lat_iters, lambda: s.raw_xfer(op, rl, idx[next(it) % 64], idx[0]),
                              lambda: s.kvt_xfer(ops[op], kl, idx[next(it) % 64], idx[0]), batch=100)
            rows.append((f"4 KiB round trip {op} (post + poll to DONE)", f"{r * 1e6:.2f} us",
                         f"{k * 1e6:.2f} us", f"{k / r:.3f}", "<= 1.2"))
            r, k = _alternate(args.lat_iters, lambda: s.raw_xfer(op, rl, idx[next(it) % 64], idx[0]),
                              lambda: s.agent_xfer(ops[op], ids[next(it) % 64], ids[0]), batch=100)
            rows.append((f"4 KiB round trip {op} through kvt.Agent", f"{r * 1e6:.2f} us",
                         f"{k * 1e6:.2f} us", f"{k / r:.3f}", "<= 1.3"))
        r, k = _alternate(max(3, args.reps // 3), lambda: _build_raw(s), lambda: _build_kvt(s))
        rows.append(("build + prep 100,000 blocks (local and remote lists)", f"{r * 1e3:.1f} ms",
                     f"{k * 1e3:.1f} ms", f"{k / r:.3f}", "reported"))
    finally:
        s.close()
    return rows


_N, _BLOCK = 100_000, 2048


def _build_raw(s: Session) -> float:
    t = time.perf_counter()
    lh = s.raw.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(s.buf.ctypes.data, _BLOCK, _N), "DRAM")
    rh = s.raw.prep_xfer_dlist(s.raw_peer, _rows(s.remote, _BLOCK, _N), "DRAM")
    dt = time.perf_counter() - t
    s.raw.release_dlist_handle(lh)
    s.raw.release_dlist_handle(rh)
    return dt


def _build_kvt(s: Session) -> float:
    t = time.perf_counter()
    lp, rp = s.kvt_lists(_BLOCK, _N)
    dt = time.perf_counter() - t
    s.kvt.release(lp)
    s.kvt.release(rp)
    return dt


def tls_sweep(args) -> list[tuple[str, ...]]:
    from kvt.types import Op

    src, dst = np.full(SIZE, 7, np.uint8), np.ones(SIZE, np.uint8)
    cp = statistics.median([_timed(lambda: np.copyto(dst, src)) for _ in range(args.reps)])
    rows = [("memcpy, same process (baseline)", "-", f"{SIZE / cp / 1e9:.2f}", f"{SIZE / cp / 1e9:.2f}", "-")]
    for tls in args.tls_sweep or SWEEP_TLS:
        for mode in ("peer", "none"):
            env = {} if tls == "default" else {"UCX_TLS": tls}
            opts = {"ucx_env": env, "backend_params": {"UCX": {"ucx_error_handling_mode": mode}},
                    "progress_thread": args.progress_thread}
            try:
                s = Session(env, opts, False)
            except Exception as e:  # a transport UCX cannot use here, or that cannot carry this mode
                rows.append((tls, mode, f"fails: {type(e).__name__}", "", ""))
                continue
            try:
                res = []
                for block, count, op in [(SIZE, 1, Op.READ), (SIZE, 1, Op.WRITE), (64 << 10, 4096, Op.READ)]:
                    lists = s.kvt_lists(block, count)
                    li, ri = np.arange(count, dtype=np.int32), np.random.default_rng(0).permutation(count).astype(np.int32)
                    s.kvt_xfer(op, lists, li, ri)
                    res.append(SIZE / statistics.median([s.kvt_xfer(op, lists, li, ri) for _ in range(args.reps)]) / 1e9)
                rows.append((tls, mode, *(f"{x:.2f}" for x in res)))
            except Exception as e:
                rows.append((tls, mode, f"fails: {type(e).__name__}: {e}", "", ""))
            finally:
                s.close()
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=21, help="timed runs per bandwidth case (median)")
    ap.add_argument("--lat-iters", type=int, default=3000, help="timed round trips per latency case (median)")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both processes (default: UCX's choice)")
    ap.add_argument("--tls-sweep", nargs="*", metavar="TLS", default=None,
                    help=f"time kvt under these UCX_TLS values instead (default: {' '.join(SWEEP_TLS)})")
    ap.add_argument("--progress-thread", action="store_true",
                    help="run NIXL's progress thread in every agent (it polls without sleeping: on a 2-core "
                         "machine four of them crowd out the measurement); default: off everywhere, the "
                         "initiator polls its transfers and the target its notifications")
    args = ap.parse_args()
    import nixl  # noqa: F401  (fail early and plainly if it is missing)
    from importlib.metadata import version

    started, load = time.time(), os.getloadavg()[0]
    if args.tls_sweep is not None:
        table = _table(("UCX_TLS", "ucx_error_handling_mode", "READ 1 x 256 MiB GB/s", "WRITE 1 x 256 MiB GB/s",
                        "READ 4096 x 64 KiB GB/s"), tls_sweep(args))
    else:
        table = _table(("case", "raw nixl_agent", "kvt nixl backend", "kvt/raw", "target"), overhead(args))
    print(f"\n`python {' '.join(sys.argv)}`  \nnixl {version('nixl')}, {platform.machine()}, {os.cpu_count()} cores, "
          f"UCX_TLS={args.ucx_tls or os.environ.get('UCX_TLS', 'default')}, progress thread "
          f"{'on' if args.progress_thread else 'off'}, load average "
          f"{load:.1f} at start, {time.time() - started:.0f} s; medians\n")
    print(table)


if __name__ == "__main__":
    main()
