"""kvt's vLLM connector under a real vLLM with tensor parallelism: each
engine's workers are separate processes, one per rank, each registering its
own share of the KV heads; a decode rank reads the heads it needs from the
prefill rank(s) holding them, whatever the two engines' TP sizes.

Checked per TP pair and backend: outputs equal a plain engine's; exactly the
prompts' whole blocks are read (bytes summed over decode ranks); and noise
written into *one* prefill rank's cache changes decode's output, so decode
read that rank's heads from that rank."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, Engine  # noqa: E402
from tiny_model import HEADS, HIDDEN, KV_HEADS, LAYERS  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MAX_TOKENS = 8
BLOCK_BYTES = 2 * LAYERS * BLOCK * KV_HEADS * (HIDDEN // HEADS) * 4  # K and V of every head, float32
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (3 * BLOCK, 5 * BLOCK + 7, 12 * BLOCK + 1)]
WHOLE = sum(len(p) // BLOCK for p in PROMPTS)

# (prefill TP, decode TP, backend): fewer, more and as many decode ranks, each backend once
CASES = [(2, 1, "host"), (1, 2, "nixl"), (2, 2, "ucx")]


def _bytes_read(engine: Engine) -> float:
    return dict(engine.call("metrics")).get("vllm:kvt_bytes_transferred_sum", 0) or 0


def _start(name: str, model: Path, logs: Path, tp: int, core: int, **config) -> Engine:
    # both ranks of a TP-2 engine share the machine's two cores; a TP-1 engine gets one
    bind = "0|1" if tp == 2 else str(core)
    return Engine.start(name, model, core=core, log_dir=logs, wait=False, tensor_parallel_size=tp,
                        env={"VLLM_CPU_OMP_THREADS_BIND": bind}, **config)


@pytest.fixture(scope="module")
def expected(tiny_model, tmp_path_factory):
    plain = Engine.start("plain-tp", tiny_model, core=1, log_dir=tmp_path_factory.mktemp("logs-tp"))
    try:
        return [o["tokens"] for o in plain.generate(PROMPTS, MAX_TOKENS)]
    finally:
        plain.close()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"tp{c[0]}-to-tp{c[1]}-{c[2]}")
def engines(request, tiny_model, tmp_path_factory):
    ptp, dtp, backend = request.param
    logs = tmp_path_factory.mktemp(f"logs-tp{ptp}{dtp}")

    def ktc(role: str) -> dict:
        return {"kv_transfer_config": {"kv_connector": "KvtConnector", "kv_role": role, "kv_connector_extra_config": {
            "backend": backend, "transfer_timeout": 10.0, "handshake_timeout": 5.0}}}

    started = []
    try:
        started.append(_start(f"prefill-tp{ptp}-{backend}", tiny_model, logs, ptp, 0, **ktc("kv_producer")))
        started.append(_start(f"decode-tp{dtp}-{backend}", tiny_model, logs, dtp, 1, **ktc("kv_consumer")))
        for e in started:
            e.ready()
        yield ptp, started[0], started[1]
    finally:
        for e in started:
            e.close()


def _handed(prefill: Engine) -> list[dict]:
    return [o["kv_transfer_params"] for o in prefill.generate(PROMPTS, 1, [{"do_remote_decode": True}] * len(PROMPTS))]


def _decode(decode: Engine, handed: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in decode.generate(PROMPTS, MAX_TOKENS, handed)]


def test_token_identical_and_every_block_read_once(engines, expected):
    ptp, prefill, decode = engines
    handed = _handed(prefill)
    assert all(p.get("tp_size", 1) == ptp and len(p["remote_endpoints"]) == ptp for p in handed), handed
    # each rank's agent, as vLLM's handshake-metadata channel gave it to the scheduler (docs/reliability.md)
    assert all([a.rsplit("-", 1)[0] for a in p["remote_agents"]] == [f"{p['remote_engine_id']}-tp{r}"
                                                                      for r in range(ptp)] for p in handed), handed
    before = _bytes_read(decode)
    assert _decode(decode, handed) == expected
    assert _bytes_read(decode) - before == WHOLE * BLOCK_BYTES


@pytest.mark.parametrize("rank", [0, 1])
def test_decode_reads_each_prefill_rank(engines, expected, rank):
    ptp, prefill, decode = engines
    if rank >= ptp:
        pytest.skip(f"the prefill engine has {ptp} rank(s)")
    assert _decode(decode, _handed(prefill)) == expected  # so the change below is the noise's
    handed = _handed(prefill)
    assert prefill.call("noise", rank) > 0
    assert all(o != e for o, e in zip(_decode(decode, handed), expected)), rank
