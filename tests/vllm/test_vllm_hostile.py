"""kvt's vLLM connector under a real vLLM against ``kv_transfer_params`` an
HTTP client chose: whoever sends an engine requests sets them per request
(``SamplingParams.extra_args`` offline, the request body's
``kv_transfer_params`` over HTTP), with any JSON in them.  Nothing in them
may stop the engine (an exception out of a connector method in the engine's
step kills the engine core), or make it read outside the request's own
blocks; a request with unusable params is computed by the decode engine
(refused: one ERROR line) or its load fails (``kv_load_failure_policy``,
here ``recompute``): either way its output is the locally computed one.

The decode engine chunks long prompts (``max_num_batched_tokens``), so a
request vLLM computes itself although it carries good params — it asks for
``prompt_logprobs``, for which vLLM skips cached KV — gets its blocks a chunk
at a time."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine import BLOCK, Engine, started  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MAX_TOKENS = 6
CHUNK = 4 * BLOCK  # the decode engine's max_num_batched_tokens
_rng = random.Random(17)
PROMPT = [_rng.randrange(3, 512) for _ in range(5 * BLOCK + 7)]
LONG = [_rng.randrange(3, 512) for _ in range(12 * BLOCK)]  # three chunks on the decode engine
DEAD = "tcp://127.0.0.1:1"  # nothing listens there


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """(prefill, decode, decode's log, {prompt: decode's own output})."""
    logs = tmp_path_factory.mktemp("logs-hostile")

    def ktc(role: str, **more) -> dict:
        return {"kv_connector": "KvtConnector", "kv_role": role, **more, "kv_connector_extra_config": {
            "backend": "host", "transfer_timeout": 5.0, "handshake_timeout": 3.0}}

    with started(tiny_model, logs,
                 dict(name="prefill-hostile", core=0, kv_transfer_config=ktc("kv_producer")),
                 dict(name="decode-hostile", core=1,
                      kv_transfer_config=ktc("kv_consumer", kv_load_failure_policy="recompute"),
                      max_num_batched_tokens=CHUNK)) as (prefill, decode):
        own = decode.generate([PROMPT, LONG], MAX_TOKENS)
        yield prefill, decode, logs / "decode-hostile.log", {"prompt": own[0]["tokens"], "long": own[1]["tokens"]}

def _handed(prefill: Engine, prompts: list[list[int]]) -> list[dict]:
    outs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [o["kv_transfer_params"] for o in outs]


def _held(prefill: Engine, want: int | None = None) -> int:
    """Requests the prefill engine still holds for readers (``want``: the
    count expected once the notifications sent so far arrived)."""
    return prefill.held(PROMPT, want)


def _refusals(log: Path) -> int:
    return sum("REFUSED its kv_transfer_params" in line for line in log.read_text(errors="replace").splitlines())


def test_hostile_params_never_stop_the_engine(engines):
    prefill, decode, log, own = engines
    idle = decode.call("scheduler")
    real = _handed(prefill, [PROMPT] * 4)
    where = {k: real[0][k] for k in ("remote_engine_id", "remote_endpoints", "expires_at", "prompt_digest")}
    dead = {"do_remote_prefill": True, "remote_engine_id": "p-x", "remote_endpoints": [DEAD], "tp_size": 1,
            "prompt_digest": real[0]["prompt_digest"]}  # this prompt's: no engine key here, nothing is signed
    refused = [  # computed by the decode engine, one ERROR line each
        {**dead, "remote_request_id": "r1", "remote_block_ids": [-1, 2, 3]},
        {**dead, "remote_request_id": "r2", "remote_block_ids": [2**64 - 1]},  # vLLM refuses bigger ints
        {**dead, "remote_request_id": "r3", "remote_block_ids": "0,1,2"},
        {**dead, "remote_request_id": "r4", "remote_block_ids": [[1], {"a": 2}]},
        {**dead, "remote_request_id": "r5", "remote_block_ids": [1, 2], "expires_at": float("nan")},
        {**dead, "remote_request_id": "r6", "remote_block_ids": [1, 2], "tp_size": 0},
        {**dead, "remote_request_id": "r7", "remote_block_ids": [1, 2], "tp_size": 5000},
        {**dead, "remote_request_id": "r8" * 2000, "remote_block_ids": [1, 2]},
        {**dead, "remote_request_id": "r9", "remote_block_ids": [1, 2], "do_remote_prefill": "yes"},
        {**dead, "remote_request_id": "r10", "remote_block_ids": [1] * 100_000 + [-5]},
        {**dead, "remote_request_id": "r11", "remote_block_ids": [1, 2], "remote_endpoints": ["ipc:///tmp/x"]},
        {"do_remote_prefill": True, "remote_block_ids": [1, 2]},  # nowhere to read from
        {**where, "do_remote_prefill": True, "remote_request_id": "r12", "remote_block_ids": [1, 2],
         "prompt_digest": None},  # names no prompt, and this request has one
    ]
    failing = [  # well-formed but unusable: the load fails and vLLM recomputes the request
        {**dead, "remote_request_id": "f1", "remote_block_ids": [1, 2, 3, 4, 5]},
        {**dead, "remote_request_id": "f2", "remote_block_ids": [1, 2, 3, 4, 5], "do_remote_decode": True,
         "junk": {"x": [[[[]]]], "y": None}},
        {**where, "do_remote_prefill": True, "remote_request_id": "forged-1", "remote_block_ids": [2**62] * 5},
        {**real[0], "remote_block_ids": [real[0]["remote_block_ids"][0], 10**12, 3, 4, 5]},
    ]
    fine = [  # read as usual
        {**real[1], "remote_block_ids": real[1]["remote_block_ids"] + list(range(10_000))},  # longer than the prompt
        {**real[2], "junk": {"deep": [[[[[[{"z": "\u0000"}]]]]]]}, "remote_host": None},
        {**real[3], "remote_block_ids": [str(b) for b in real[3]["remote_block_ids"]]},
        {}, {"do_remote_prefill": False}, {"junk": 1},
    ]
    before = _refusals(log)
    params = refused + failing + fine
    outs = decode.generate([PROMPT] * len(params), MAX_TOKENS, params, timeout=180)
    assert [o["tokens"] for o in outs] == [own["prompt"]] * len(params)
    assert _refusals(log) - before == len(refused)
    assert decode.call("scheduler") == idle  # nothing left allocated or tracked
    # the prefill engine frees what decode read or gave up on: real[0] after its failed read
    assert _held(prefill, 0) == 0
    # and the pair still works
    assert decode.generate([PROMPT], MAX_TOKENS, _handed(prefill, [PROMPT]))[0]["tokens"] == own["prompt"]


def test_params_handed_off_for_another_prompt_are_refused(engines):
    """Params any user of the prefill engine gets for one prompt, sent to the
    decode engine with another: the decode engine used to read the first
    prompt's KV into the second's blocks and then serve them from its prefix
    cache to everyone asking the second prompt.  Refused now (one ERROR
    line): the decode engine computes the request itself."""
    prefill, decode, log, own = engines
    other = [t + 1 for t in PROMPT]
    before = _refusals(log)
    handed = _handed(prefill, [other])[0]
    assert decode.generate([PROMPT], MAX_TOKENS, [handed])[0]["tokens"] == own["prompt"]
    assert _refusals(log) - before == 1


def test_hostile_params_to_the_prefill_engine(engines):
    """Malformed fields are refused on a prefill request too (computed, not
    handed off); unknown keys and nulls are ignored (handed off)."""
    prefill, decode, _, own = engines
    held = _held(prefill)
    refused = [{"do_remote_decode": True, "remote_block_ids": [-1]},
               {"do_remote_decode": "yes", "tp_size": "many"},
               {"do_remote_decode": True, "do_remote_prefill": "x", "remote_block_ids": [1]},
               {"do_remote_decode": True, "remote_engine_id": {"a": 1}}]
    handed_off = [{"do_remote_decode": True, "junk": [[[{"x": None}]]], "remote_block_ids": None},
                  {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}]
    outs = prefill.generate([PROMPT] * 6, MAX_TOKENS, refused + handed_off)
    assert [o["tokens"] for o in outs] == [own["prompt"]] * 6
    assert [bool(o["kv_transfer_params"]) for o in outs] == [False] * 4 + [True] * 2
    # the decode engine reads the two handed off (max_tokens 6: held until then)
    handed = [o["kv_transfer_params"] for o in outs[4:]]
    assert [o["tokens"] for o in decode.generate([PROMPT] * 2, MAX_TOKENS, handed)] == [own["prompt"]] * 2
    assert _held(prefill, held) == held


def test_prompt_logprobs_with_handed_params_and_chunked_prefill(engines):
    """vLLM computes a request asking for ``prompt_logprobs`` itself
    (num_external_tokens 0) and allocates its long prompt a chunk at a time:
    this used to raise out of update_state_after_alloc and kill the decode
    engine core.  The request is computed locally and the prefill engine is
    told to free its blocks at once."""
    prefill, decode, _, own = engines
    held = _held(prefill)
    handed = _handed(prefill, [LONG])
    out = decode.generate([LONG], MAX_TOKENS, handed, sampling={"prompt_logprobs": 1})[0]
    assert out["tokens"] == own["long"]
    assert _held(prefill, held) == held  # freed at once, not after abort_request_timeout
    assert decode.generate([LONG], MAX_TOKENS, _handed(prefill, [LONG]))[0]["tokens"] == own["long"]
