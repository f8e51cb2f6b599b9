"""kvt's vLLM connector under a real vLLM whose decode engine has KV blocks
for one of its requests at a time: vLLM keeps the others waiting and asks
the connector about each again every step until blocks free up (kvt checks
a request's params once and remembers the result, docs/integration.md).
The engines share an ``auth_key``, so what is remembered includes the tag
check.  Every request must still be read once, in full, and decode to the
tokens the decode engine computes by itself."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, started  # noqa: E402
from tiny_model import HEADS, HIDDEN, KV_HEADS, LAYERS  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MAX_TOKENS = 4
BLOCKS = 16         # the decode engine's whole KV cache
PROMPT_BLOCKS = 12  # a request takes 13 blocks with its output: two never fit at once
BLOCK_BYTES = 2 * LAYERS * BLOCK * KV_HEADS * (HIDDEN // HEADS) * 4  # K and V, float32
_rng = random.Random(23)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(PROMPT_BLOCKS * BLOCK)] for _ in range(4)]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """(prefill, decode with ``BLOCKS`` blocks, decode's own outputs for PROMPTS)."""
    logs = tmp_path_factory.mktemp("logs-pressure")
    env = {"KVT_AUTH_KEY": "pressure-" + "k" * 32}

    def ktc(role: str) -> dict:
        return {"kv_connector": "KvtConnector", "kv_role": role, "kv_connector_extra_config": {
            "backend": "host", "transfer_timeout": 10.0, "handshake_timeout": 5.0}}

    with started(tiny_model, logs,
                 dict(name="prefill-pressure", core=0, env=env, kv_transfer_config=ktc("kv_producer")),
                 dict(name="decode-pressure", core=1, env=env, kv_transfer_config=ktc("kv_consumer"),
                      num_gpu_blocks_override=BLOCKS,
                      max_model_len=(BLOCKS - 1) * BLOCK)) as (prefill, decode):  # (vLLM keeps one block back)
        yield prefill, decode, [o["tokens"] for o in decode.generate(PROMPTS, MAX_TOKENS)]

def test_requests_waiting_for_blocks_are_each_read_once_in_full(engines):
    prefill, decode, own = engines
    assert decode.call("scheduler")["blocks"] <= BLOCKS  # so at most one request runs at a time
    handed = [o["kv_transfer_params"] for o in prefill.generate(PROMPTS, 1, [{"do_remote_decode": True}] * 4)]
    assert all(len(p["remote_block_ids"]) == PROMPT_BLOCKS and p.get("kvt_mac") for p in handed)
    before = decode.metric("vllm:kvt_bytes_transferred_sum")
    outs = decode.generate(PROMPTS, MAX_TOKENS, handed)
    assert [o["tokens"] for o in outs] == own
    read = (decode.metric("vllm:kvt_bytes_transferred_sum") - before) / BLOCK_BYTES
    assert read == 4 * PROMPT_BLOCKS  # none refused (computed by decode instead), none read twice
    assert decode.metric("vllm:kvt_num_malformed_params") == 0
    assert decode.call("scheduler")["requests"] == 0
    assert prefill.held(PROMPTS[0], 0) == 0  # each released by its reader
