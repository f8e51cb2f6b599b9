"""``kvt demo``: prefill and decode processes move KV blocks; bytes verified."""

from __future__ import annotations

import argparse
import json
import os

from . import add_config_arguments, check_seconds, config_from_args, format_bytes, physical_memory

_COUNTS = ("layers", "blocks", "request_blocks", "block_size", "heads", "head_dim", "iters", "requests")
#: upper bounds of the counts memory does not bound: every read's latency is kept (and sent to this
#: process), every request is planned up front and reported on its own line
MAX_COUNTS = {"iters": 10**8, "requests": 10**6}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="move a request's KV blocks between two processes and verify them",
                              description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=256, help="blocks in each side's KV cache")
    p.add_argument("--request-blocks", type=int, default=128, help="blocks the request moves (per layer)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10,
                   help=f"timed reads (after one warm-up read); at most {MAX_COUNTS['iters']:,}")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--engine", action="store_true",
                   help="run the reference engine instead: prefill and decode workers as processes, "
                        "--requests requests of mixed lengths (up to --request-blocks blocks), every decoded "
                        "block verified; prints per-request latency and total throughput")
    p.add_argument("--requests", type=int, default=16,
                   help=f"with --engine: how many requests; at most {MAX_COUNTS['requests']:,}")
    p.add_argument("--in-process", action="store_true",
                   help="with --engine: run the decode worker in this process, as vLLM runs a single-GPU "
                        "engine's (the prefill worker stays a process of its own)")
    add_config_arguments(p)
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot run before any process starts: counts below 1, a timeout that is not a
    finite number of seconds, and KV caches that do not fit in this machine's memory."""
    from ..errors import InvalidArgument

    for name in _COUNTS:
        if getattr(args, name) < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name, limit in MAX_COUNTS.items():
        if getattr(args, name) > limit:
            raise InvalidArgument(f"--{name} must be at most {limit:,}, got {getattr(args, name):,}")
    check_seconds(args.timeout, "--timeout")
    if args.in_process and not args.engine:
        raise InvalidArgument("--in-process applies to the reference engine only: use it with --engine")
    # each side's cache: layers x blocks x (K, V) x heads x tokens x head dim, float16
    side = args.layers * args.blocks * 2 * args.heads * args.block_size * args.head_dim * 2
    have = physical_memory()
    if have and 2 * side > have:
        raise InvalidArgument(f"the two KV caches need {format_bytes(2 * side)} of memory, more than this machine's "
                              f"{format_bytes(have)}; lower --layers, --blocks, --heads, --block-size or --head-dim")


def run(args: argparse.Namespace) -> int:
    from ..demo import DemoSpec, run as run_demo
    from ..errors import BackendUnavailable, InvalidArgument
    from ..registry import load_backend, own_options

    check_args(args)
    config = config_from_args(args)
    backend = config.backend
    cls = load_backend(backend, config.backend_source)
    options = own_options(backend, config.options, config.shared_options)  # a typo refused before any child starts
    if not cls.capabilities.remote:  # the demo's two sides are two processes
        raise BackendUnavailable(f"backend {backend!r} declares remote=False (it reaches agents of its own process "
                                 "only); kvt demo moves blocks between two processes: choose another --backend")
    if args.engine:
        from ..config import ENV_CONFIG
        from ..connector.engine_demo import engine_demo

        if args.config:  # the engines' workers load their settings (auth_key, integrity...) as a real engine's do
            os.environ[ENV_CONFIG] = args.config

        return engine_demo(backend=backend, backend_options=options, requests=args.requests,
                           layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                           block_size=args.block_size, blocks=args.blocks, max_request_blocks=args.request_blocks,
                           timeout=args.timeout, as_json=args.json, in_process=args.in_process)
    if not 0 < args.request_blocks <= args.blocks:
        raise InvalidArgument(f"--request-blocks must be in 1..--blocks ({args.blocks}), got {args.request_blocks}")
    spec = DemoSpec(config=config, layers=args.layers, blocks=args.blocks, heads=args.heads,
                    block_size=args.block_size, head_dim=args.head_dim, request_blocks=args.request_blocks,
                    iters=args.iters, timeout=args.timeout)
    r = run_demo(spec)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        ok = "OK: every byte verified" if r["mismatched_bytes"] == 0 else f"MISMATCH: {r['mismatched_bytes']} bytes differ"
        print(f"kvt demo  backend={backend}  prefill -> decode (2 processes)")
        print(f"  blocks    {r['blocks']} ({spec.layers} layers x {spec.request_blocks} blocks of "
              f"{r['bytes'] // r['blocks']} B)")
        print(f"  bytes     {r['bytes']} ({r['bytes'] / 2**20:.1f} MiB)")
        print(f"  latency   median {r['median_s'] * 1e3:.3f} ms over {spec.iters} reads "
              f"(min {min(r['latencies']) * 1e3:.3f}, max {max(r['latencies']) * 1e3:.3f})")
        print(f"  bandwidth {r['gbps']:.2f} GB/s")
        print(f"  {ok}")
    return 0 if r["mismatched_bytes"] == 0 else 1
