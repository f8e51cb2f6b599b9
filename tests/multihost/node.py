"""A kvt agent on a test host, driven by the test over stdin/stdout.

Run as ``ip netns exec NS python node.py SPEC`` (``SPEC`` is JSON: name,
backend, options, listen address/port, blocks, block size, salt).  It
registers ``blocks`` blocks filled with ``pattern(salt)``, listens on the
side channel, prints one JSON line ``{"endpoint": ...}``, then answers one
JSON command per line with one JSON line:

    {"cmd": "connect", "endpoint": E}              -> {"peer": name}
    {"cmd": "read", "peer": P, "local": [..], "remote": [..], "salt": S}
        -> {"ok": true, "verified": bool}  or  {"ok": false, "error": TypeName, "msg": ...}
    {"cmd": "write", ...same...}                   -> same (verified by the peer's "check")
    {"cmd": "check", "ids": [..], "salt": S}       -> {"verified": bool}
    {"cmd": "resolve", "name": N}                  -> {"endpoint": E} (through KVT_DISCOVERY)
    {"cmd": "paths"}                               -> backend-specific path facts
    {"cmd": "quit"}

Every command answers; a kvt error becomes ``{"ok": false, ...}``, anything
else kills the node (the test then sees EOF).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def pattern(num_blocks: int, block: int, salt: int) -> np.ndarray:
    """Every block distinct, every byte position distinct, a different ``salt`` different bytes."""
    x = np.arange(num_blocks * block, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(salt * 0x9E3779B1)
    return (x >> np.uint64(7)).astype(np.uint8).reshape(num_blocks, block)


def main() -> None:
    spec = json.loads(sys.argv[1])
    # our replies go to a copy of stdout; whatever a backend prints (native code
    # too) goes to stderr and cannot corrupt them
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from kvt import Agent, KvtError, Op

    nb, bs = spec["blocks"], spec["block"]
    buf = pattern(nb, bs, spec["salt"])
    with Agent(name=spec["name"], backend=spec["backend"], options=spec["options"]) as agent:
        agent.register_blocks("kv", [buf])
        endpoint = agent.listen(spec["addr"], spec.get("port", 0))
        if spec.get("publish"):  # discovery: under our name, with a lease
            agent.publish(spec["publish"], spec.get("ttl"))
        print(json.dumps({"endpoint": endpoint, "name": agent.name}), file=out, flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            cmd, rep = req["cmd"], {}
            try:
                if cmd == "connect":
                    rep["peer"] = agent.connect(req["endpoint"])
                elif cmd in ("read", "write"):
                    local, remote = req["local"], req["remote"]
                    if cmd == "write":  # what we push: the blocks the peer will check
                        buf[local] = pattern(nb, bs, req["salt"])[remote]
                    else:
                        buf[local] = 0
                    t = agent.transfer_blocks(Op(cmd.upper()), req["peer"], local, remote)
                    try:
                        t.wait(req.get("timeout"))
                    finally:
                        t.release()
                    rep["ok"] = True
                    if cmd == "read":
                        rep["verified"] = bool((buf[local] == pattern(nb, bs, req["salt"])[remote]).all())
                elif cmd == "resolve":
                    rep["endpoint"] = agent.discovery.resolve(req["name"])
                elif cmd == "check":
                    rep["verified"] = bool((buf[req["ids"]] == pattern(nb, bs, req["salt"])[req["ids"]]).all())
                elif cmd == "paths":
                    peers = getattr(agent.backend, "_peers", {})
                    rep = {name: {"same_host": getattr(p, "same_host", None)} for name, p in peers.items()}
                elif cmd == "quit":
                    break
                else:
                    rep = {"ok": False, "error": "BadCommand", "msg": cmd}
            except KvtError as e:
                rep = {"ok": False, "error": type(e).__name__, "msg": str(e)}
            print(json.dumps(rep), file=out, flush=True)


if __name__ == "__main__":
    main()
