"""Vetting a peer's UCX worker address and remote keys before UCX sees them.

UCX trusts the bytes it unpacks: a worker address or remote key that is not
one of its own can make ``ucp_ep_create`` or ``ucp_ep_rkey_unpack`` assert or
segfault (tests/security's fuzzing of ucx metadata finds such blobs within a
few thousand tries).  Two layers, in order:

1. Envelopes (``kvt.ucxkeys``): the address must carry our UCX's
   address-format version (UCX asserts on any other), and each remote key
   must be a host-memory key laid out exactly as ``ucp_rkey_pack`` writes
   one: a forged memory type or length sends UCX's protocol selection
   reading out of bounds, a crash that depends on the memory layout.
2. A sandbox (``kvt.sandbox``): a long-lived child process with the same UCX
   settings makes the same ``ucp_ep_create``/``ucp_ep_rkey_unpack`` calls
   first (``probe`` below); if it dies or hangs, the metadata is refused and
   the next check starts a new child.  This catches what UCX does
   deterministically wrong with bytes that pass 1.  A child that survives
   says nothing about the peer: UCX errors (an unreachable peer, a key it
   refuses) surface again, typed, when this process makes the same calls.

Cost: one pipe round trip per ``add_remote`` (about a millisecond).  The
child (a Python interpreter and a UCP context) starts when the backend first
hands out its metadata; starting takes about 0.5 s here (0.16 s importing
kvt, 0.4 s loading UCX), so a peer whose metadata arrives sooner (a decode
engine given work right after start) waits that out in its first
``add_remote``, once.  A lease shorter than that plus the read cannot be met
on the first request (the connector then refuses the read as too late).
"""

from __future__ import annotations

from typing import Callable

import msgspec
from kvt import sandbox
from kvt.errors import WireError
from kvt.ucxkeys import is_host_rkey, same_address_format

__all__ = ["vet", "start", "probe"]

_PROBE = f"{__name__}:probe"


def vet(config: dict[str, str], ours: bytes, address: bytes, rkeys: list[bytes], peer_mode: bool,
        who: str) -> None:
    """``WireError`` unless ``address`` (ours: our own worker address) and
    ``rkeys`` pass both layers for the UCX settings ``config``."""
    if not same_address_format(address, ours):
        raise WireError(f"metadata of {who!r}: a UCX worker address in a format this UCX does not speak; "
                        "run the same UCX release on both sides")
    for k in rkeys:
        if k and not is_host_rkey(k):
            raise WireError(f"metadata of {who!r}: a remote key that is not a UCX host-memory key; "
                            "run the same UCX release on both sides")
    sandbox.vet(_PROBE, config, msgspec.msgpack.encode([address, rkeys, peer_mode]),
                f"metadata of {who!r}: UCX crashed on its worker address or remote keys (tried in a "
                "sandbox process first); refused. Is the peer running the same UCX release?")


def start(config: dict[str, str]) -> None:
    """Start the sandbox for ``config`` ahead of the first peer (``kvt.sandbox.start``)."""
    sandbox.start(_PROBE, config)


def probe(config: dict[str, str]) -> Callable[[bytes], None]:
    """The sandbox's check (``kvt.sandbox``): one worker with ``config``; per
    payload, connect, unpack every key, close."""
    from . import native

    ucp = native.load()
    worker = ucp.Worker(b"kvt-ucx-sandbox", config, 1 << 10, 1, 1 << 10)

    def check(payload: bytes) -> None:
        address, rkeys, peer_mode = msgspec.msgpack.decode(payload)
        ep = worker.connect(address, peer_mode)
        try:
            for k in rkeys:
                if k:
                    ep.unpack(k).destroy()
        finally:
            ep.close()
    return check
