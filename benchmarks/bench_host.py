"""Host backend: cross-process READ and WRITE bandwidth next to same-run baselines.

    python benchmarks/bench_host.py [--size-mib 256] [--iters 10]

The target process owns one buffer (in kvt shared memory, or for the ``cma``
row in private heap memory); the initiator moves it to or from its own warm
private buffer as one block.  Baselines, measured in the initiator and
alternating with the transfers so that all see the same machine:

* ``memcpy private``: between two private buffers (huge pages where THP
  allows: numpy advises them for large arrays).
* ``memcpy same pages``: between a kvt shared segment and a private buffer,
  in the direction of the transfer: the same page kinds the shm path copies
  (a segment's pages are what ``kvt backends`` says: 4 KiB when shmem THP is
  off).  The shm and tcp rows' "same-page" ratios use it; the cma row's use
  ``memcpy private`` (its target's buffer is private heap, like ours).

Every memcpy baseline is one numpy copy on one thread; the host backend's
copy engine splits requests of ``SPLIT_BYTES`` and more over up to
``THREADS`` threads (printed above the table), so its ratios can pass 1.
* ``socket``: for the tcp row, a plain two-process stream of the same bytes
  over loopback TCP (``sendall`` of the whole buffer, ``recv_into`` the
  destination), request to last byte; alternating with that row's transfers
  and memcpys like the other baselines (measured apart from them, before
  2026-11-28, it had a quieter machine than the transfers it was set
  against).

Prints a markdown table; best of ``--iters`` for each.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import socket
import time

import numpy as np


def _target(nbytes: int, shared: bool, q, stop) -> None:
    from kvt import Agent, memory

    buf = memory.empty(nbytes) if shared else np.empty(nbytes, np.uint8)
    buf[:] = 7  # touch every page before timing
    with Agent(name="target", backend="host") as agent:
        agent.register_blocks("buf", [buf.reshape(1, -1)])
        q.put(agent.listen())
        stop.wait(300)


def _stream_sender(nbytes: int, q, stop) -> None:
    """The socket baseline's peer: per request byte, send the whole buffer."""
    buf = np.full(nbytes, 7, np.uint8)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            while not stop.is_set() and conn.recv(1):
                conn.sendall(memoryview(buf))


def _best(fn, iters: int) -> float:
    best = float("inf")
    for _ in range(iters + 1):  # the first round warms up
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _host_rows(endpoint: str, nbytes: int, iters: int, transport: str, stream=None) -> dict:
    """GB/s of READ and WRITE and of both memcpy baselines, interleaved
    (and of ``stream``, a function receiving the socket baseline's bytes)."""
    from kvt import Agent, memory

    dst = np.ones(nbytes, np.uint8)
    a, b = np.full(nbytes, 7, np.uint8), np.ones(nbytes, np.uint8)
    seg = memory.empty(nbytes)
    seg[:] = 7
    out = {}
    with Agent(name="initiator", backend="host", options={"transport": transport}) as agent:
        agent.register_blocks("buf", [dst.reshape(1, -1)])
        peer = agent.connect(endpoint)

        def move(op):
            with agent.transfer_blocks(op, peer, [0], [0], layout="buf") as x:
                x.wait(120)

        runs = [("private", lambda: np.copyto(b, a)), ("seg->private", lambda: np.copyto(b, seg)),
                ("private->seg", lambda: np.copyto(seg, a)), ("READ", lambda: move("READ")),
                ("WRITE", lambda: move("WRITE"))] + ([("socket", stream)] if stream else [])
        t = {k: float("inf") for k, _ in runs}
        for _ in range(iters + 1):
            for key, fn in runs:
                t[key] = min(t[key], _best(fn, 0))
        assert (dst[::4096] == 7).all(), "data did not arrive"
    for k, v in t.items():
        out[k] = nbytes / v / 1e9
    return out


@contextlib.contextmanager
def _socket_stream(nbytes: int, ctx):
    """A function that receives the socket baseline's ``nbytes`` once, its sender in another process."""
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_stream_sender, args=(nbytes, q, stop), daemon=True)
    p.start()
    try:
        dst = np.zeros(nbytes, np.uint8)
        view = memoryview(dst)
        with socket.create_connection(("127.0.0.1", q.get(timeout=60))) as s:
            def one():
                s.sendall(b"x")
                got = 0
                while got < nbytes:
                    n = s.recv_into(view[got:])
                    if not n:
                        raise ConnectionError("sender closed")
                    got += n
            yield one
        assert (dst[::4096] == 7).all()
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    nbytes = args.size_mib << 20
    ctx = mp.get_context("spawn")
    from kvt import memcopy, memory

    results = []
    for label, shared, transport in [("shm (shared-memory target)", True, "auto"),
                                     ("cma (private-heap target)", False, "auto"),
                                     ("tcp (forced, loopback)", True, "tcp")]:
        q, stop = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=_target, args=(nbytes, shared, q, stop), daemon=True)
        p.start()
        try:
            with contextlib.ExitStack() as on_tcp:
                stream = on_tcp.enter_context(_socket_stream(nbytes, ctx)) if transport == "tcp" else None
                results.append((label, shared, _host_rows(q.get(timeout=60), nbytes, args.iters, transport, stream)))
        finally:
            stop.set()
            p.join(10)
            if p.is_alive():
                p.kill()
    kind, why = memory.page_policy(nbytes)
    print(f"\n{args.size_mib} MiB, 2 processes, best of {args.iters}; copy engine {memcopy.ENGINE} "
          f"({memcopy.THREADS} threads at >= {memcopy.SPLIT_BYTES >> 20} MiB inline, "
          f"{memcopy.BACKGROUND_THREADS} on a worker); "
          f"segments: {kind} pages ({why})\n")
    print("| path | READ GB/s | WRITE GB/s | memcpy private | memcpy seg->private | memcpy private->seg "
          "| socket | READ x same-page memcpy | WRITE x same-page memcpy | READ x socket |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, shared, r in results:
        # the same page kinds as the row's copy: a shared (4 KiB page) segment, or for cma the
        # target's private heap, huge pages like the initiator's
        same_r, same_w = (r["seg->private"], r["private->seg"]) if shared else (r["private"], r["private"])
        sock = r.get("socket")
        socket_col, vs_sock = (f"{sock:.2f}", f"{r['READ'] / sock:.2f}") if sock else ("-", "-")
        print(f"| {label} | {r['READ']:.2f} | {r['WRITE']:.2f} | {r['private']:.2f} | {r['seg->private']:.2f} "
              f"| {r['private->seg']:.2f} | {socket_col} | {r['READ'] / same_r:.2f} | {r['WRITE'] / same_w:.2f} "
              f"| {vs_sock} |")


if __name__ == "__main__":
    main()
