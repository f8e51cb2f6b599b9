"""``kvt demo --engine``: N requests of mixed lengths through the reference
engine (prefill and decode workers as processes) on the chosen backend;
prints each request's latency and the total throughput."""

from __future__ import annotations

import json
import statistics

from .reference import EngineSpec, ToyModel, mixed_requests, run_pd, summary

__all__ = ["engine_demo"]


def engine_demo(*, backend: str, backend_options: dict, requests: int, layers: int, heads: int, head_dim: int,
                block_size: int, blocks: int, max_request_blocks: int, timeout: float, as_json: bool = False,
                in_process: bool = False, echo=print) -> int:
    """Run the demo and print its report; the exit code (0: every request
    decoded with verified contents and nothing leaked).  ``in_process``: the
    decode worker runs in this process, as vLLM runs a single-GPU engine's."""
    model = ToyModel(layers=layers, kv_heads=heads, head_dim=head_dim, block_size=block_size, name="demo")
    specs = mixed_requests(requests, block_size, max_request_blocks, seed=0)
    engine = {"model": model, "num_blocks": blocks, "backend": backend, "backend_options": dict(backend_options)}
    report = run_pd(EngineSpec("prefill", **engine), EngineSpec("decode", **engine, in_process=in_process), specs,
                    timeout=timeout)
    results = list(report.results.values())
    good = all(r.status == "ok" and r.mismatches == 0 for r in results) and not report.leaks
    if as_json:
        echo(json.dumps(summary(report), indent=2))
        return 0 if good else 1
    lens = {s.request_id: s.prompt_len for s in specs}
    where = "decode worker in this process" if in_process else "worker processes"
    echo(f"kvt demo --engine  backend={backend}  prefill TP1 -> decode TP1 (reference engine, {where})")
    echo("  latency: load = decode read scheduled -> loaded; end-to-end = prefill admitted -> decode verified")
    echo(f"  {'request':<10} {'tokens':>7} {'blocks read':>12} {'load ms':>9} {'end-to-end ms':>14}  status")
    for r in results:
        echo(f"  {r.request_id:<10} {lens[r.request_id]:>7} {r.loaded_blocks:>12} {r.load_latency * 1e3:>9.2f} "
             f"{r.latency * 1e3:>14.2f}  {r.status}{'' if not r.reason else ': ' + r.reason}")
    lat = sorted(r.latency for r in results)
    loads = sorted(r.load_latency for r in results if r.loaded_blocks)
    tokens = sum(lens[r.request_id] for r in results if r.status == "ok")
    moved = report.bytes_moved
    echo(f"  requests    {sum(r.status == 'ok' for r in results)} ok of {len(results)} in {report.elapsed:.3f} s")
    if loads:
        echo(f"  load        median {statistics.median(loads) * 1e3:.2f} ms, max {loads[-1] * 1e3:.2f} ms "
             f"({len(loads)} requests read blocks)")
    echo(f"  end-to-end  median {statistics.median(lat) * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms")
    echo(f"  throughput  {len(results) / report.elapsed:.1f} requests/s, {tokens / report.elapsed:.0f} prompt "
         f"tokens/s, {moved / 2**20:.1f} MiB of KV moved ({moved / report.elapsed / 1e9:.3f} GB/s)")
    echo("  OK: every decoded block verified, nothing leaked" if good else
         f"  FAILED: leaks {report.leaks or 'none'}; see the status column")
    return 0 if good else 1
