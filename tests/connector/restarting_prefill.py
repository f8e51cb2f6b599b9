"""A prefill engine in a process of its own (tests/connector/test_connector_restart.py):
one rank on the host backend, on a fixed side-channel port, so that a restart
comes back where the last one was.  It hands request ``argv[2]`` off from
blocks ``argv[3]`` (comma-separated) of a cache filled from seed ``argv[4]``,
prints one JSON line (the params, and those blocks of each layer), then one
line per request it releases, until its stdin closes."""

from __future__ import annotations

import json
import os
import select
import sys
import time

import torch

from kvt import memory
from kvt.connector import ConnectorConfig, ConnectorScheduler, ConnectorWorker, EngineRequest, KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", block_size=4)
BLOCKS = 16


def main() -> None:
    port, req_id, seed = int(sys.argv[1]), sys.argv[2], int(sys.argv[4])
    blocks = [int(b) for b in sys.argv[3].split(",")]
    config = ConnectorConfig(engine_id="p", kv=SPEC, backend="host", side_channel_port=port,
                             abort_request_timeout=float(os.environ.get("ABORT_TIMEOUT", "30")))
    torch.manual_seed(seed)
    shape = (2, BLOCKS, *SPEC.block_shape(1))
    kv = {f"l{i}": memory.empty_tensor(shape, torch.float16) for i in range(SPEC.num_layers)}
    for t in kv.values():
        t.copy_(torch.randn(shape).half())
    with ConnectorWorker(config, 0) as worker:
        sched = ConnectorScheduler(config)
        sched.set_worker_endpoints({0: worker.register_kv_caches(kv)}, {0: worker.agent.name})
        _, params = sched.request_finished(EngineRequest(req_id, 2 * SPEC.block_size, {"do_remote_decode": True}),
                                           blocks)
        worker.start_load_kv(sched.build_connector_meta())
        print(json.dumps({"params": params, "blocks": {n: t[:, blocks].float().tolist() for n, t in kv.items()}}),
              flush=True)
        deadline = time.monotonic() + 120  # never outlives a stuck test by much
        while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.01)[0]:
            released, _ = worker.get_finished()
            for r in sorted(released):
                print(json.dumps({"released": r, "by_readers": worker.stats["released_by_readers"]}), flush=True)


if __name__ == "__main__":
    main()
