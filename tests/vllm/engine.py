"""A real vLLM engine (``vllm.LLM``) in its own process, driven over a
``multiprocessing.connection`` socket: ``Engine.start(...)`` in the test,
``python engine.py ADDRESS`` in the child.  Its engine core runs in the
child process itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so killing the
child kills the engine; each engine gets its own core for vLLM's OpenMP
pinning (``VLLM_CPU_OMP_THREADS_BIND``) and a small KV cache."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
START_TIMEOUT = 300.0


class Engine:
    """The test's handle on one engine process; every call has a timeout."""

    def __init__(self, proc: subprocess.Popen, conn: Any, name: str, log: Path):
        self.proc, self.conn, self.name, self.log = proc, conn, name, log

    @classmethod
    def start(cls, name: str, model: Path, *, core: int, kv_transfer_config: dict | None = None,
              env: dict[str, str] | None = None, log_dir: Path, wait: bool = True,
              **llm_args: Any) -> "Engine":
        """Launch the engine; with ``wait=False`` call ``ready()`` before using it
        (so several engines start at once).  ``llm_args`` override ``vllm.LLM``'s."""
        key = secrets.token_bytes(16)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                         "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVT_ENGINE_KEY": key.hex(), **(env or {})}
            log = log_dir / f"{name}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen([sys.executable, __file__, f"{listener.address[0]}:{listener.address[1]}"],
                                        env=child_env, stdout=out, stderr=subprocess.STDOUT)
            listener._listener._socket.settimeout(60)
            conn = listener.accept()
        engine = cls(proc, conn, name, log)
        conn.send(("init", (dict(model=str(model), kv_transfer_config=kv_transfer_config, **llm_args),)))
        if wait:
            engine.ready()
        return engine

    def ready(self) -> None:
        """Wait until the engine is up (``RuntimeError`` with its failure if it is not)."""
        self._reply("init", START_TIMEOUT)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the engine's log, for a failing assertion's message
        (CI keeps no temporary files)."""
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(line[:400] for line in text)

    def call(self, op: str, *args: Any, timeout: float = 120.0) -> Any:
        self.conn.send((op, args))
        return self._reply(op, timeout)

    def _reply(self, op: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited ({self.proc.returncode}); see its log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name}: {op} took over {timeout}s")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"engine {self.name}: {op} failed:\n{value}")
        return value

    def metric(self, name: str) -> float:
        """A counter's or gauge's value, a histogram's count (``name + "_sum"``: its sum); 0 if absent."""
        metrics = dict(self.call("metrics"))
        return metrics.get(name, metrics.get(name + "_total", 0)) or 0

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None] | None = None,
                 timeout: float = 120.0, sampling: dict | None = None) -> list[dict]:
        """Greedy outputs: ``{"tokens", "finish_reason", "kv_transfer_params"}`` per prompt
        (``sampling``: more ``SamplingParams`` arguments for every prompt)."""
        return self.call("generate", prompts, max_tokens, params, sampling, timeout=timeout)

    def held(self, prompt: list[int], want: int | None = None, timeout: float = 10.0) -> int:
        """Requests this (prefill) engine's scheduler still holds for readers.
        It takes the readers' notifications when it steps, and one sent just
        before may still be on its way: step (``prompt``, one token) until the
        count is ``want`` (``None``: once) or ``timeout`` passes, and return
        the last count."""
        deadline = time.monotonic() + timeout
        while True:
            self.generate([prompt], 1)
            count = self.call("scheduler")["requests"]
            if want is None or count == want or time.monotonic() > deadline:
                return count
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send(("exit", ()))
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


@contextlib.contextmanager
def started(model: Path, log_dir: Path, *engines: dict[str, Any]) -> Iterator[list[Engine]]:
    """Engines started at once (each dict: ``Engine.start``'s arguments
    besides the model and log folder), up before the body runs, all closed
    after it."""
    out: list[Engine] = []
    try:
        for kw in engines:
            out.append(Engine.start(model=model, log_dir=log_dir, wait=False, **kw))
        for e in out:
            e.ready()
        yield out
    finally:
        for e in out:
            e.close()


# -- the child ---------------------------------------------------------------

def _child(address: str) -> None:
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["KVT_ENGINE_KEY"]))
    llm = None
    while True:
        op, args = conn.recv()
        if op == "exit":
            return
        try:
            if op == "init":
                llm = _make_llm(**args[0])
                value = None
            elif op == "generate":
                value = _generate(llm, *args)
            elif op == "noise":  # args: (rank,) or () for every rank
                value = sum(llm.collective_rpc(_noise_kv_caches, args=args))
            elif op == "metrics":
                value = _metrics(llm)
            elif op == "abort_after":
                value = _abort_after(llm, *args)
            elif op == "scheduler":
                value = _scheduler_state(llm)
            elif op == "start":
                value = _start(llm, *args)
            elif op == "shutdown":
                value = _shutdown(llm)
            elif op == "setenv":  # kvt's test hooks read at use (KVT_INTEGRITY_TEST_FLIP)
                os.environ.update(args[0])
                value = None
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send((True, value))
        except BaseException:  # report it: the test shows the traceback
            import traceback
            conn.send((False, traceback.format_exc()))


def _make_llm(**args: Any):
    from vllm import LLM

    return LLM(**{"skip_tokenizer_init": True, "dtype": "float32", "block_size": BLOCK, "max_model_len": 2048,
                  "enable_prefix_caching": False, "enforce_eager": True, "seed": 0, "max_num_seqs": 8,
                  "disable_log_stats": False, **args})


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, params: list[dict | None] | None,
              sampling: dict | None = None) -> list[dict]:
    """Each output also carries ``seconds``: the whole batch's time in this process."""
    from vllm import SamplingParams

    sps = [SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
                          extra_args={"kv_transfer_params": p} if p is not None else None, **(sampling or {}))
           for p in (params or [None] * len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return [{"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
             "kv_transfer_params": o.kv_transfer_params, "seconds": seconds} for o in outs]


def _abort_after(llm: Any, prompts: list[list[int]], max_tokens: int, params: list[dict | None],
                 seconds: float, timeout: float = 120.0) -> list[dict]:
    """Add the requests, step the engine, abort them all after ``seconds``,
    step until the engine has nothing left: ``{"finish_reason", "tokens"}``
    per request as its last output said (None if it never produced one)."""
    from vllm import SamplingParams

    engine, ids, last = llm.llm_engine, [f"abort-{i}-{time.monotonic_ns()}" for i in range(len(prompts))], {}
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p is not None else None))
    t0, aborted = time.monotonic(), False
    while engine.has_unfinished_requests() or not aborted:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"requests unfinished {timeout}s after abort")
        if not aborted and time.monotonic() - t0 >= seconds:
            engine.abort_request(ids)
            aborted = True
        for o in engine.step():
            last[o.request_id] = {"finish_reason": o.outputs[0].finish_reason, "tokens": list(o.outputs[0].token_ids)}
        time.sleep(0.01)
    return [last.get(rid) for rid in ids]


def _start(llm: Any, prompts: list[list[int]], max_tokens: int, params: list[dict | None],
           seconds: float) -> dict:
    """Add the requests and step the engine for ``seconds``, then return
    (leaving them in flight): ``{"unfinished": n, "finished": {id: reason}}``."""
    from vllm import SamplingParams

    engine, finished = llm.llm_engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"start-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p is not None else None))
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0].finish_reason
        time.sleep(0.01)
    return {"unfinished": engine.get_num_unfinished_requests(), "finished": finished}


def _scheduler_state(llm: Any) -> dict:
    """What the engine core's scheduler holds: requests it still tracks and
    free KV blocks (needs the engine core in this process, as here)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    return {"requests": len(sched.requests), "free_blocks": pool.get_num_free_blocks(),
            "blocks": pool.num_gpu_blocks}


def _shutdown(llm: Any) -> dict:
    """Shut the engine core down as vLLM does at exit (its worker's connector
    included, which needs the worker in this process, as with one TP rank):
    how long that took and what the kvt worker held afterwards."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    held = worker.outstanding()
    t0 = time.monotonic()
    llm.llm_engine.engine_core.shutdown()
    return {"seconds": time.monotonic() - t0, "before": held, "after": worker.outstanding(),
            "closed": worker._closed and worker.agent._closed}


def _metrics(llm: Any) -> list[tuple[str, Any]]:
    """``(name, value)``: a counter's or gauge's value, a histogram's count,
    and its sum as ``name + "_sum"``."""
    out = []
    for m in llm.get_metrics():
        out.append((m.name, getattr(m, "value", getattr(m, "count", None))))
        if hasattr(m, "sum"):
            out.append((m.name + "_sum", m.sum))
    return out


def _noise_kv_caches(worker: Any, rank: int | None = None) -> int:
    """Overwrite every KV cache block of this worker with noise, if it is
    tensor-parallel rank ``rank`` (any rank if None); returns how many
    elements (test only)."""
    import torch

    if rank is not None and worker.rank != rank:
        return 0
    caches = worker.model_runner.kv_caches
    n = 0
    for t in (caches.values() if isinstance(caches, dict) else caches):
        t.copy_(torch.randn(t.shape, dtype=t.dtype) * 3)
        n += t.numel()
    return n


if __name__ == "__main__":
    _child(sys.argv[1])
