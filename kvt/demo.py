"""``kvt demo``: a prefill process and a decode process move a request's KV
blocks through the configured backend; every byte is verified.

The prefill side fills a KV cache (layers x blocks x 2 x heads x block size x
head dim) with seeded random contents and serves it; the decode side pulls
the request's blocks into different block slots of its own cache, then
regenerates the expected contents and compares every transferred byte (and
checks that no other block was touched).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from .config import Config
from .errors import KvtError
from .procs import child_of

_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class DemoSpec:
    config: Config = Config()
    layers: int = 4
    blocks: int = 256
    heads: int = 8
    block_size: int = 16
    head_dim: int = 128
    dtype: str = "float16"
    request_blocks: int = 128
    iters: int = 10
    seed: int = 0
    timeout: float = 60.0

    @property
    def shape(self) -> tuple[int, ...]:  # per layer, block-first; 2 = K and V
        return (self.blocks, 2, self.heads, self.block_size, self.head_dim)


def kv_cache(spec: DemoSpec, fill: bool):
    """Per-layer tensors in kvt shared memory; seeded contents if ``fill``."""
    import torch

    from .memory import empty_tensor

    dtype = getattr(torch, spec.dtype)
    layers = [empty_tensor(spec.shape, dtype) for _ in range(spec.layers)]
    if fill:
        for i, t in enumerate(layers):
            t.copy_(expected_layer(spec, i))
    return layers


def expected_layer(spec: DemoSpec, layer: int):
    import torch

    g = torch.Generator().manual_seed(spec.seed * 1000 + layer)
    return torch.randn(spec.shape, generator=g).to(getattr(torch, spec.dtype))


def _prefill(spec: DemoSpec, out: mp.Queue, done, parent: int) -> None:
    child_of(parent)
    try:
        from .agent import Agent

        with Agent(name="prefill", config=spec.config) as agent:
            agent.register_blocks("kv", kv_cache(spec, fill=True))
            out.put(("endpoint", agent.listen()))
            agent.wait_notif("decode", timeout=spec.timeout, match=b"finished")
            deadline = time.monotonic() + spec.timeout
            while not done.value and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception as e:  # the process boundary: the parent reports it in one line (no traceback)
        out.put(("error", f"prefill: {type(e).__name__}: {e}"))


def _decode(spec: DemoSpec, endpoint: str, out: mp.Queue, parent: int) -> None:
    child_of(parent)
    try:
        import torch

        from .agent import Agent

        with Agent(name="decode", config=spec.config) as agent:
            cache = kv_cache(spec, fill=False)
            agent.register_blocks("kv", cache)
            peer = agent.connect(endpoint)
            rng = np.random.default_rng(spec.seed)
            remote = rng.choice(spec.blocks, spec.request_blocks, replace=False)
            local = rng.permutation(spec.blocks)[:spec.request_blocks]
            with agent.read_blocks(peer, local, remote) as x:  # warm-up, not timed
                x.wait(spec.timeout)
            lat = []
            for i in range(spec.iters):
                t0 = time.perf_counter()
                with agent.read_blocks(peer, local, remote, notif=f"req-{i}".encode()) as x:
                    x.wait(spec.timeout)
                lat.append(time.perf_counter() - t0)
                nbytes = x.nbytes
            agent.notify(peer, b"finished")
            bad = 0
            untouched = np.setdiff1d(np.arange(spec.blocks), local)
            for layer, t in enumerate(cache):
                want = expected_layer(spec, layer)
                got_u8 = t.view(torch.uint8).reshape(spec.blocks, -1)
                want_u8 = want.view(torch.uint8).reshape(spec.blocks, -1)
                bad += int((got_u8[torch.from_numpy(local)] != want_u8[torch.from_numpy(remote)]).sum())
                bad += int(got_u8[torch.from_numpy(untouched)].count_nonzero())
            out.put(("result", {"blocks": spec.request_blocks * spec.layers, "bytes": nbytes,
                                "latencies": lat, "mismatched_bytes": bad}))
    except Exception as e:  # the process boundary, as in _prefill
        out.put(("error", f"decode: {type(e).__name__}: {e}"))


def _expect(q: mp.Queue, kind: str, timeout: float, procs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            what, value = q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise KvtError(f"{dead[0].name} process exited with code {dead[0].exitcode}")
            continue
        if what == "error":
            raise KvtError(value)
        if what == kind:
            return value
    raise KvtError(f"demo: no {kind} within {timeout:g}s")


def run(spec: DemoSpec, echo=print) -> dict:
    """Run the demo; returns the decode side's result.  Raises ``KvtError``."""
    ctx = mp.get_context("spawn")
    # done: a shared byte, not an Event, whose set() would wait for ever on a killed waiter
    q, done = ctx.Queue(), ctx.Value("b", 0, lock=False)
    pre = ctx.Process(target=_prefill, args=(spec, q, done, os.getpid()), name="prefill", daemon=True)
    procs = [pre]
    try:
        pre.start()
        endpoint = _expect(q, "endpoint", spec.timeout, procs)
        dec = ctx.Process(target=_decode, args=(spec, endpoint, q, os.getpid()), name="decode", daemon=True)
        procs.append(dec)
        dec.start()
        result = _expect(q, "result", spec.timeout, procs)
        done.value = 1
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    lat = sorted(result["latencies"])
    result["median_s"] = statistics.median(lat)
    result["gbps"] = result["bytes"] / result["median_s"] / 1e9
    result["spec"] = {**asdict(spec), "config": spec.config.shown()}
    return result
