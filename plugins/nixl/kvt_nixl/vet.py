"""Trying a peer's NIXL blob in a sandbox before ``add_remote_agent`` here.

``check_nixl_blob`` refuses what is known to crash NIXL or UCX (malformed
records, foreign address formats, forged remote keys).  What passes can
still carry a UCX worker address that UCX's connect misreads: fuzzing a
live peer's connection record found addresses
that segfault ``add_remote_agent`` within the first thousand tries.  So a
long-lived child with an agent of the same settings loads the blob first
(``kvt.sandbox``); a blob that kills or hangs it is refused.

Cost: about a millisecond per new blob.  The child (an interpreter and a
NIXL agent: 0.2 s, 62 MB) starts when the backend first hands out its
metadata, so it is usually up by the time a peer's arrives.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from kvt import sandbox

from . import native
from .metadata import agent_name

__all__ = ["vet", "start", "probe"]

_PROBE = f"{__name__}:probe"


def vet(settings: dict[str, Any], blob: bytes, who: str) -> None:
    """``WireError`` if loading ``blob`` crashes or hangs an agent made with
    ``settings`` (the arguments of ``native.new_agent`` as JSON)."""
    sandbox.vet(_PROBE, settings, blob,
                f"NIXL metadata of {who!r}: NIXL/UCX crashed loading it (tried in a sandbox process "
                "first); refused. Is the peer running the same NIXL/UCX release?")


def start(settings: dict[str, Any]) -> None:
    """Start the sandbox for ``settings`` ahead of the first peer (``kvt.sandbox.start``)."""
    sandbox.start(_PROBE, settings)


def probe(settings: dict[str, Any]) -> Callable[[bytes], None]:
    """The sandbox's check: one agent like the caller's (no progress thread);
    per blob, load it and forget it."""
    # nixl's package picks its CUDA build from torch's, importing torch as a last resort (a CPU
    # build: a second and 200 MB here, for "no CUDA", the same answer as without torch)
    sys.modules.setdefault("torch", None)
    agent = native.new_agent(f"kvt-nixl-sandbox-{os.getpid()}", settings["backends"], settings["params"],
                             settings["num_threads"], False, settings["env"])

    def check(blob: bytes) -> None:
        try:
            agent.add_remote_agent(blob)
        finally:
            try:
                agent.remove_remote_agent(agent_name(blob))
            except Exception:  # noqa: BLE001 - it was not loaded
                pass
    return check
