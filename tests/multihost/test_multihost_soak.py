"""Soak across two test hosts: many reads on every backend with packet loss,
the prefill agent killed and restarted under the same name, and frozen for a
while.  Every request ends completed (bytes verified) or failed cleanly with a
kvt error; none corrupted, none hung.

CI runs a short version; ``KVT_SOAK_REQUESTS=10000`` (total, split over the
backends) runs the full one, ``KVT_SOAK_LOSS`` sets the loss in percent
(default 1), ``KVT_SOAK_REPORT=file.json`` writes the figures
(docs/reliability.md records them)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
from kvt_conformance.peer import freeze

from cluster import BACKENDS, NUM_BLOCKS, NodeFailure, need_backend

REQUESTS = int(os.environ.get("KVT_SOAK_REQUESTS", "240"))
LOSS = float(os.environ.get("KVT_SOAK_LOSS", "1"))
TIMEOUT = 2.0
_figures: dict[str, dict] = {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak(net, nodes, backend):
    need_backend(backend)
    a, b = net.hosts
    for h in (a, b):
        h.netem(loss_pct=LOSS)
    n = max(REQUESTS // len(BACKENDS), 30)
    restarts, freeze_at = {n // 3, (2 * n) // 3}, n // 2
    env = {"KVT_INTEGRITY": "1"}
    salt = 1
    prefill = nodes(a, "prefill", backend, salt=salt, port=7800, timeout=TIMEOUT, env=env)
    decode = nodes(b, "decode", backend, salt=99, timeout=TIMEOUT, env=env)
    peer = decode.call("connect", endpoint=prefill.endpoint)["peer"]
    counts = dict.fromkeys(("completed", "failed_cleanly", "corrupted", "hung", "restarts", "freezes"), 0)
    errors: dict[str, int] = {}
    rnd = random.Random(15)
    t0 = time.monotonic()
    for i in range(n):
        if i in restarts:
            prefill.kill()
            salt += 1
            prefill = nodes(a, "prefill", backend, salt=salt, port=7800, timeout=TIMEOUT, env=env)
            counts["restarts"] += 1
        if i == freeze_at:
            freeze(prefill.proc.pid)  # every thread stopped, not just signalled
            counts["freezes"] += 1
        if i == freeze_at + 3:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        ids = rnd.sample(range(NUM_BLOCKS), 4)
        try:
            rep = decode.read(peer, ids, ids[::-1], salt=salt, timeout=3 * TIMEOUT + 10)
        except NodeFailure:
            counts["hung"] += 1
            break
        if rep.get("ok"):
            counts["completed" if rep["verified"] else "corrupted"] += 1
        else:
            counts["failed_cleanly"] += 1
            errors[rep["error"]] = errors.get(rep["error"], 0) + 1
    counts.update(requests=n, seconds=round(time.monotonic() - t0, 1), loss_pct=LOSS, errors=errors)
    _figures[backend] = counts
    if path := os.environ.get("KVT_SOAK_REPORT"):
        with open(path, "w") as f:
            json.dump(_figures, f, indent=1)
    print(backend, counts)
    assert counts["corrupted"] == 0 and counts["hung"] == 0, counts
    # each restart costs about one request, the freeze a few, loss the odd timeout: more means a
    # peer that came back was not picked up again
    assert counts["failed_cleanly"] <= 10 + n // 100, counts
