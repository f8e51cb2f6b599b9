"""Agents with and without ``auth_key`` on one backend, in a process of its
own (run by test_auth.py): ``auth_agents.py BACKEND works|forged``.  Prints
``ok`` on success; exit 3 = backend not usable here (skip)."""

from __future__ import annotations

import sys
import time

import numpy as np
from kvt import Agent, registry
from kvt.auth import NotifSeal, Secret
from kvt.config import load_config
from kvt.errors import AuthenticationError, KvtError

KEY = "test-shared-key-0123456789abcdef"
WRONG = "someone-elses-key-0123456789abcd"


def agent(backend: str, key: str | None) -> Agent:
    return Agent(config=load_config(backend, env={"KVT_AUTH_KEY": key} if key else {}))


def works(backend: str) -> None:
    with agent(backend, KEY) as a, agent(backend, KEY) as b, agent(backend, None) as c, agent(backend, WRONG) as d:
        src = (np.arange(8 * 4096) % 251).astype(np.uint8).reshape(8, 4096)
        dst = np.zeros_like(src)
        b.register_blocks("kv", [src])
        a.register_blocks("kv", [dst])
        peer = a.connect(b.listen())
        b.connect(a.listen())
        a.read_blocks(peer, [0, 1, 2], [5, 6, 7], notif=b"read-done").wait()
        assert np.array_equal(dst[:3], src[5:8])
        a.notify(peer, b"hello")
        assert b.wait_notif(a.name, match=b"hello", timeout=10) == (a.name, b"hello")
        assert b.wait_notif(a.name, match=b"read-done", timeout=10) == (a.name, b"read-done")
        for outsider in (c, d):
            try:
                outsider.connect(b.listen())
            except AuthenticationError as e:
                assert "auth_key" in str(e) and KEY not in str(e)
            else:
                raise AssertionError(f"{outsider.name} connected without the key")


def forged(backend: str) -> None:
    with agent(backend, KEY) as a, agent(backend, KEY) as b:
        peer = a.connect(b.listen())
        b.connect(a.listen())
        a.backend.notify(peer, b"forged")  # the raw channel: no seal
        sealed = a._seal(peer, b"once")
        a.backend.notify(peer, sealed)
        a.backend.notify(peer, sealed)  # replayed
        a.backend.notify(peer, NotifSeal(Secret(WRONG), a.name).seal(peer, b"", b"wrong-key"))
        a.notify(peer, b"last")
        assert b.wait_notif(a.name, match=b"last", timeout=10)
        time.sleep(0.5)  # anything else in flight lands (no timing assertion: only what arrived is checked)
        got = [m for ms in b.get_notifs().values() for m in ms]
        assert got == [b"once"], got


if __name__ == "__main__":
    backend, case = sys.argv[1:3]
    try:
        usable = registry.probe(backend).usable
    except KvtError:
        usable = False
    if not usable:
        print(f"backend {backend} not usable here")
        sys.exit(3)
    {"works": works, "forged": forged}[case](backend)
    print("ok")
