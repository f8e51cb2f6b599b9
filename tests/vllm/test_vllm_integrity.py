"""kvt's vLLM connector under a real vLLM with integrity checks on
(``KVT_INTEGRITY=1`` on both engines): every read is proven against the
prefill engine's digests before vLLM is told it loaded.  A byte flipped in
each landed read (the test hook, as a corrupting link would leave it) fails
the load, and the decode engine (``kv_load_failure_policy="recompute"``)
computes the request itself; before, the checks did not cover the
connector's reads and corrupted KV was used."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, Engine, started  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

MAX_TOKENS = 6
_rng = random.Random(29)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (6 * BLOCK + 3, 9 * BLOCK)]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """(prefill, decode, decode's own outputs for PROMPTS)."""
    logs = tmp_path_factory.mktemp("logs-integrity")
    env = {"KVT_INTEGRITY": "1"}

    def ktc(role: str, **more) -> dict:
        return {"kv_connector": "KvtConnector", "kv_role": role, "kv_connector_extra_config": {
            "backend": "host", "transfer_timeout": 10.0, "handshake_timeout": 5.0}, **more}

    with started(tiny_model, logs,
                 dict(name="prefill-integrity", core=0, env=env, kv_transfer_config=ktc("kv_producer")),
                 dict(name="decode-integrity", core=1, env=env,
                      kv_transfer_config=ktc("kv_consumer", kv_load_failure_policy="recompute"))) as (prefill, decode):
        yield prefill, decode, [o["tokens"] for o in decode.generate(PROMPTS, MAX_TOKENS)]


def _handed(prefill: Engine) -> list[dict]:
    return [o["kv_transfer_params"] for o in prefill.generate(PROMPTS, 1, [{"do_remote_decode": True}] * len(PROMPTS))]


def test_proven_reads_load(engines):
    prefill, decode, own = engines
    before = decode.metric("vllm:kvt_bytes_transferred_sum")
    assert [o["tokens"] for o in decode.generate(PROMPTS, MAX_TOKENS, _handed(prefill))] == own
    assert decode.metric("vllm:kvt_bytes_transferred_sum") > before  # read, not computed
    assert decode.metric("vllm:kvt_num_failed_recvs") == 0
    assert prefill.held(PROMPTS[0], 0) == 0  # each released by its reader, once proven


def test_corrupted_reads_are_recomputed_not_used(engines):
    prefill, decode, own = engines
    failed = decode.metric("vllm:kvt_num_failed_recvs")
    decode.call("setenv", {"KVT_INTEGRITY_TEST_FLIP": "1"})
    try:
        outs = decode.generate(PROMPTS, MAX_TOKENS, _handed(prefill))
    finally:
        decode.call("setenv", {"KVT_INTEGRITY_TEST_FLIP": "0"})
    assert [o["tokens"] for o in outs] == own
    assert decode.metric("vllm:kvt_num_failed_recvs") == failed + len(PROMPTS)
    assert prefill.held(PROMPTS[0], 0) == 0  # the failed readers released them too
    # and the engines carry on: proven reads load again
    assert [o["tokens"] for o in decode.generate(PROMPTS, MAX_TOKENS, _handed(prefill))] == own
