"""What checking ``kv_transfer_params`` costs a decode engine's scheduler per
request, with and without ``auth_key`` (signing on the prefill side, the tag
check and the used-once memory on the decode side).

    python benchmarks/bench_params.py [--blocks 16,1024,100000] [--reps 200]

Per request: the prefill scheduler's ``request_finished`` (signs with a
key), then the decode scheduler's ``get_num_new_matched_tokens`` and
``update_state_after_alloc`` (as vLLM calls them) and
``build_connector_meta``.  Without a key is the baseline of the same run;
``json`` is a ``json.loads(json.dumps(params))`` round trip, what the
params cost the router and vLLM's HTTP layer anyway; ``wait step`` is one
more ``get_num_new_matched_tokens`` of a request already asked about, what
vLLM spends on it every step it waits for free blocks; ``after load`` is
the ask vLLM makes once more after the load was scheduled (its
``do_remote_prefill`` cleared).  Requests carry their prompt's token ids
(a list, as vLLM's do), so both sides' ``prompt_digest`` is in the figures;
``--no-tokens`` leaves them out (an engine without token ids).  Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from kvt.connector import ConnectorConfig, ConnectorScheduler, EngineRequest, KVCacheSpec

SPEC = KVCacheSpec(model="m", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)


def schedulers(key: str | None) -> tuple[ConnectorScheduler, ConnectorScheduler]:
    os.environ.pop("KVT_AUTH_KEY", None)
    if key:
        os.environ["KVT_AUTH_KEY"] = key
    try:
        prefill = ConnectorScheduler(ConnectorConfig(engine_id="p", kv=SPEC))
        prefill.set_worker_endpoints({0: "tcp://127.0.0.1:7000"}, {0: "p-tp0-bench"})
        return prefill, ConnectorScheduler(ConnectorConfig(engine_id="d", kv=SPEC))
    finally:
        os.environ.pop("KVT_AUTH_KEY", None)


def one(prefill: ConnectorScheduler, decode: ConnectorScheduler, blocks: list[int], i: int,
        prompt: list[int] | None) -> tuple[float, ...]:
    """(prefill, decode, json round trip, wait step, after load) seconds of one request."""
    tokens = len(blocks) * SPEC.block_size
    t0 = time.perf_counter()
    _, params = prefill.request_finished(EngineRequest(f"p{i}", tokens, {"do_remote_decode": True}, prompt), blocks)
    prefill.build_connector_meta()
    t1 = time.perf_counter()
    params = json.loads(json.dumps(params))
    t2 = time.perf_counter()
    req = EngineRequest(f"d{i}", tokens, params, prompt)
    n, _ = decode.get_num_new_matched_tokens(req, 0)
    decode.update_state_after_alloc(req, blocks, n)
    assert decode.build_connector_meta().reqs_to_recv
    t3 = time.perf_counter()
    assert decode.get_num_new_matched_tokens(req, n) == (0, False)
    t_after = time.perf_counter() - t3
    _, params = prefill.request_finished(EngineRequest(f"w{i}", tokens, {"do_remote_decode": True}, prompt), blocks)
    prefill.build_connector_meta()
    waiting = EngineRequest(f"w{i}", tokens, json.loads(json.dumps(params)), prompt)
    assert decode.get_num_new_matched_tokens(waiting, 0)[0] == tokens
    t4 = time.perf_counter()
    decode.get_num_new_matched_tokens(waiting, 0)
    t5 = time.perf_counter()
    decode.request_finished(waiting, [], aborted=True)
    assert decode.build_connector_meta().reqs_to_recv
    return t1 - t0, t3 - t2, t2 - t1, t5 - t4, t_after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="16,1024,100000")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-tokens", action="store_true", help="requests without prompt token ids")
    args = ap.parse_args()
    print(f"{'blocks':>8} {'key':>4} {'prefill us':>11} {'decode us':>10} {'json us':>8} {'wait step us':>13} {'after load us':>14}")
    for nblocks in map(int, args.blocks.split(",")):
        blocks = list(range(nblocks))
        prompt = None if args.no_tokens else [(t * 7919) % 128_000 for t in range(nblocks * SPEC.block_size)]
        reps = max(5, args.reps * 1024 // max(nblocks, 1024))
        pairs = {"no": schedulers(None), "yes": schedulers("bench-" + "k" * 32)}
        times: dict[str, list[tuple[float, ...]]] = {k: [] for k in pairs}
        for i in range(reps):  # alternate, so machine load hits both alike
            for k, (p, d) in pairs.items():
                times[k].append(one(p, d, blocks, i, prompt))
        for k, ts in times.items():
            med = [statistics.median(t[j] for t in ts) * 1e6 for j in range(5)]
            print(f"{nblocks:>8} {k:>4} {med[0]:>11.1f} {med[1]:>10.1f} {med[2]:>8.1f} {med[3]:>13.1f} {med[4]:>14.1f}")


if __name__ == "__main__":
    main()
