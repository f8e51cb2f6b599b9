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
2. A sandbox: a long-lived child process with the same UCX settings makes the
   same ``ucp_ep_create``/``ucp_ep_rkey_unpack`` calls first; if it dies or
   hangs, the metadata is refused and the next check starts a new child.
   This catches what UCX does deterministically wrong with bytes that pass 1.
   A child that survives says nothing about the peer: UCX errors (an
   unreachable peer, a key it refuses) surface again, typed, when this
   process makes the same calls.

Cost: one pipe round trip per ``add_remote`` (about a millisecond), plus the
child's start (a Python interpreter and a UCP context) on first use.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time

import msgspec
from kvt.errors import WireError
from kvt.ucxkeys import is_host_rkey, same_address_format

__all__ = ["vet"]

_MAX_MESSAGE = 1 << 22  # what one check may send the child (address + keys are far smaller)
_START_TIMEOUT = 60.0
_CHECK_TIMEOUT = 10.0

_CHILD = [sys.executable, "-m", __name__]  # the sandbox's command line, then the settings (JSON)
_lock = threading.Lock()
_children: dict[str, subprocess.Popen] = {}  # UCX settings (JSON) -> child


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
    _sandbox(config, address, rkeys, peer_mode, who)


def _sandbox(config: dict[str, str], address: bytes, rkeys: list[bytes], peer_mode: bool, who: str) -> None:
    key = json.dumps(config, sort_keys=True)
    msg = msgspec.msgpack.encode([address, rkeys, peer_mode])
    with _lock:
        child = _children.get(key)
        if child is None or child.poll() is not None:
            child = _children[key] = _start(key)
        if _ask(child, msg):
            return
        child.kill()
        child.wait()
        del _children[key]
    raise WireError(f"metadata of {who!r}: UCX crashed on its worker address or remote keys (tried in a "
                    "sandbox process first); refused. Is the peer running the same UCX release?")


def _start(config: str) -> subprocess.Popen:
    child = subprocess.Popen([*_CHILD, config], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
    if _read(child, 2, _START_TIMEOUT) != b"up":
        child.kill()
        child.wait()
        raise WireError("the UCX sandbox process that vets peer metadata did not start; "
                        "check that the ucx plugin loads (`kvt backends`)")
    return child


def _ask(child: subprocess.Popen, msg: bytes) -> bool:
    try:
        child.stdin.write(struct.pack("<I", len(msg)) + msg)
        child.stdin.flush()
    except OSError:
        return False
    return _read(child, 2, _CHECK_TIMEOUT) == b"ok"


def _read(child: subprocess.Popen, n: int, timeout: float) -> bytes:
    out, fd, deadline = b"", child.stdout.fileno(), time.monotonic() + timeout
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return out
        chunk = child.stdout.read1(n - len(out))
        if not chunk:  # the child died
            return out
        out += chunk
    return out


def _serve(config: dict[str, str]) -> None:
    """The child: one worker; per request, connect, unpack, close, answer."""
    from . import native

    # the answers get the original stdout to themselves: UCX logs to fd 1 (UCX_PROTO_INFO,
    # UCX_LOG_LEVEL), which would otherwise corrupt them and make every peer look hostile
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    ucp = native.load()
    worker = ucp.Worker(b"kvt-ucx-sandbox", config, 1 << 10, 1, 1 << 10)
    stdin = sys.stdin.buffer
    stdout.write(b"up")
    stdout.flush()
    while (head := stdin.read(4)) and len(head) == 4:
        (n,) = struct.unpack("<I", head)
        if n > _MAX_MESSAGE:
            return
        address, rkeys, peer_mode = msgspec.msgpack.decode(stdin.read(n))
        try:
            ep = worker.connect(address, peer_mode)
            try:
                for k in rkeys:
                    if k:
                        ep.unpack(k).destroy()
            finally:
                ep.close()
        except ucp.Error:
            pass  # not a crash: this process will see the same error, typed
        stdout.write(b"ok")
        stdout.flush()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
