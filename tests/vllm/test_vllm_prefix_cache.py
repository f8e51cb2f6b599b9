"""kvt's vLLM connector with vLLM's prefix caching on (vLLM's default), on
the default backend: the decode engine holds part of a prompt already, so
kvt reads only the blocks past its local hit, or none at all and only tells
the prefill engine to free.  Outputs must match a plain engine's, and the
prefill engine must free every held request because its reader said so, not
because ``abort_request_timeout`` ran out."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, Engine  # noqa: E402
from tiny_model import HEADS, HIDDEN, KV_HEADS, LAYERS  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MAX_TOKENS = 8
BLOCK_BYTES = 2 * LAYERS * BLOCK * KV_HEADS * (HIDDEN // HEADS) * 4  # K and V, float32
HOLD = 30.0  # the prefill engine's abort_request_timeout: every request here is read well before

_rng = random.Random(11)
_BASE = [_rng.randrange(3, 512) for _ in range(6 * BLOCK + 5)]
PROMPTS = {
    "base": _BASE,
    "shares_3_blocks": _BASE[:3 * BLOCK] + [_rng.randrange(3, 512) for _ in range(4 * BLOCK + 9)],
    "base_again": list(_BASE),
    "fresh": [_rng.randrange(3, 512) for _ in range(5 * BLOCK + 1)],
}


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """(plain, prefill, decode), all three with prefix caching."""
    logs = tmp_path_factory.mktemp("logs-prefix-cache")

    def ktc(role: str, **extra) -> dict:
        return {"kv_connector": "KvtConnector", "kv_role": role,
                "kv_connector_extra_config": {"backend": "host", "transfer_timeout": 10.0, **extra}}

    started = []
    try:
        for name, core, config in (("plain", 1, None), ("prefill", 0, ktc("kv_producer", abort_request_timeout=HOLD)),
                                   ("decode", 1, ktc("kv_consumer"))):
            started.append(Engine.start(f"{name}-prefix-cache", tiny_model, core=core, log_dir=logs,
                                        kv_transfer_config=config, enable_prefix_caching=True))
        yield tuple(started)
    finally:
        for e in started:
            e.close()


def _through(prefill: Engine, decode: Engine, name: str) -> tuple[list[int], dict]:
    """Prefill ``name``, decode it with the handed params: (tokens, params)."""
    params = prefill.generate([PROMPTS[name]], 1, [{"do_remote_decode": True}])[0]["kv_transfer_params"]
    return decode.generate([PROMPTS[name]], MAX_TOKENS, [params])[0]["tokens"], params


def test_prefix_hits_read_only_what_decode_lacks(engines):
    plain, prefill, decode = engines
    expected = {n: o["tokens"] for n, o in zip(PROMPTS, plain.generate(list(PROMPTS.values()), MAX_TOKENS))}
    read = []  # blocks kvt read into the decode engine, after each prompt

    def blocks_read() -> float:
        return decode.metric("vllm:kvt_bytes_transferred_sum") / BLOCK_BYTES

    before = blocks_read()
    for name, hit_blocks in (("base", 0), ("shares_3_blocks", 3), ("base_again", 6), ("fresh", 0)):
        tokens, params = _through(prefill, decode, name)
        assert tokens == expected[name], name
        whole = len(PROMPTS[name]) // BLOCK
        assert len(params["remote_block_ids"]) == whole, name
        now = blocks_read()
        read.append((name, now - before, whole - hit_blocks))
        before = now
    assert [(n, got) for n, got, _ in read] == [(n, want) for n, _, want in read]


def test_prefill_frees_what_decode_read_or_already_had(engines):
    """Past ``abort_request_timeout``, nothing expired: every held request,
    the full local hit included, was released by its reader."""
    _, prefill, decode = engines
    _through(prefill, decode, "base_again")  # a full hit again: decode only notifies
    time.sleep(HOLD + 2)
    prefill.generate([PROMPTS["fresh"]], 1)  # the engine steps, so the connector reports
    assert prefill.metric("vllm:kvt_num_expired_sends") == 0
