"""Trying a peer's bytes in a child process before a native library sees them here.

UCX (and NIXL around it) trust the worker addresses and remote keys a peer
sends: forged ones make them assert or segfault, which no ``try`` survives.
Envelope checks (``kvt.ucxkeys``) refuse what is known to crash; a sandbox
catches the rest of what crashes deterministically.  A plugin names a
*probe*, ``"module:factory"``: in the child, ``factory(settings)`` builds
the library's state once (a UCP worker, a NIXL agent with the same settings
as the caller's) and returns ``check(payload)``, which makes the same calls
the caller is about to make.  If the child dies or hangs, the payload is
refused (``WireError``) and the next check starts a new child.  An exception
``check`` raises is not a crash: the caller sees the same error, typed, when
it makes the calls itself.  A surviving child says nothing about the peer.

One long-lived child per (probe, settings), at most ``MAX_CHILDREN`` per
process: a check pays a pipe round trip, and the first one for its
settings the child's start (an interpreter and the library's set-up)
unless the plugin called ``start`` earlier.  A child is replaced after
``MAX_CHECKS`` checks, so what a library keeps of each payload (NIXL: a
connection to every peer whose blob it loaded) does not pile up.  The core imports no plugin:
only the child imports the probe.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from .errors import WireError

__all__ = ["vet", "start"]

_MAX_MESSAGE = 1 << 26  # what one check may send the child (callers bound their payloads far below)
START_TIMEOUT = 60.0
CHECK_TIMEOUT = 10.0
MAX_CHILDREN = 4  # per process: one per plugin and settings in use; each is a process with the library loaded
#: checks a child serves before a fresh one replaces it: a library may keep something of every payload
#: it loaded (NIXL keeps the connection a peer's blob opened, at both ends, after remove_remote_agent)
MAX_CHECKS = 64

CHILD = [sys.executable, "-m", __name__]  # the sandbox's command line, then the probe and settings


class _Child:
    """A sandbox process; ``up`` once it has said so."""

    def __init__(self, key: tuple[str, str]):
        self.proc = subprocess.Popen([*CHILD, *key], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, close_fds=True)
        self.up = False
        self.checks = 0


_lock = threading.Lock()
_children: dict[tuple[str, str], _Child] = {}  # (probe, settings as JSON) -> child


def _forget() -> None:
    """In a forked child: the parent's sandboxes (and lock) are the parent's.
    Our copies of their pipes are closed: a sandbox ends when its input
    does, which a copy held here would put off until this process exits."""
    global _lock, _children
    for child in _children.values():
        for f in (child.proc.stdin, child.proc.stdout):
            try:
                f.close()  # (nothing buffered: checks are written with os.write)
            except OSError:
                pass
    _lock, _children = threading.Lock(), {}


os.register_at_fork(after_in_child=_forget)


def start(probe: str, settings: dict[str, Any]) -> None:
    """Start the child for ``probe`` and ``settings`` now, without waiting
    for it: a plugin calls this when it is created, so that its first peer
    does not wait for the child's start (a fifth of a second for NIXL)."""
    with _lock:
        try:
            _child(probe, settings)
        except OSError:  # vet says why
            pass


def vet(probe: str, settings: dict[str, Any], payload: bytes, refusal: str) -> None:
    """Run ``probe``'s check on ``payload`` in the sandbox child for
    ``settings`` (JSON-serialisable); ``WireError(refusal)`` if it crashed
    or hung there.  Checks are serialised per process (they are rare: one
    per peer loaded)."""
    with _lock:
        try:
            key = _child(probe, settings)
        except OSError as e:  # e.g. no interpreter at sys.executable (an embedding application)
            raise WireError(f"could not start the sandbox process that vets peer metadata ({e}); "
                            f"kvt.sandbox.CHILD is {CHILD}") from e
        child = _children[key]
        if not child.up:
            if _read(child.proc, 2, START_TIMEOUT) != b"up":
                _drop(key)
                raise WireError(f"the sandbox process that vets peer metadata ({probe}) did not start; "
                                "check that its plugin loads (`kvt backends`)")
            child.up = True
        if _ask(child.proc, payload):
            child.checks += 1
            if child.checks >= MAX_CHECKS:  # retired, and its successor started now, not at the next check
                _drop(key)
                try:
                    _child(probe, settings)
                except OSError:  # the next check says why
                    pass
            return
        _drop(key)
    raise WireError(refusal)


def _child(probe: str, settings: dict[str, Any]) -> tuple[str, str]:
    """The key of the live child for ``probe`` and ``settings``, started if
    need be; the least recently used child goes beyond ``MAX_CHILDREN``."""
    key = (probe, json.dumps(settings, sort_keys=True))
    child = _children.pop(key, None)
    if child is None or child.proc.poll() is not None:
        while len(_children) >= MAX_CHILDREN:
            _drop(next(iter(_children)))
        child = _Child(key)
    _children[key] = child  # the most recently used last
    return key


def _drop(key: tuple[str, str]) -> None:
    proc = _children.pop(key).proc
    proc.kill()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:  # a write the child never read: nothing to flush to a killed child
            pass
    try:
        proc.wait(START_TIMEOUT)  # SIGKILLed: only a process stuck in the kernel takes long
    except subprocess.TimeoutExpired:
        pass


def _wait(fd: int, event: int, deadline: float) -> bool:
    """``fd`` is ready for ``event`` (or hung up) before ``deadline``; poll(),
    not select(): a busy process's pipes may be numbered past FD_SETSIZE (1024)."""
    p = select.poll()
    p.register(fd, event)
    left = deadline - time.monotonic()
    return left > 0 and bool(p.poll(max(1, int(left * 1000))))


def _ask(child: subprocess.Popen, payload: bytes) -> bool:
    """Send ``payload``; True if the child answers ``ok`` within ``CHECK_TIMEOUT``
    in all (a child that stops reading cannot hold us in a blocking write)."""
    deadline = time.monotonic() + CHECK_TIMEOUT
    data = memoryview(struct.pack("<Q", len(payload)) + bytes(payload))
    fd = child.stdin.fileno()
    try:
        os.set_blocking(fd, False)
        while data:
            if not _wait(fd, select.POLLOUT, deadline):
                return False
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
    except (OSError, ValueError):  # the child died (EPIPE), or its pipe is closed
        return False
    return _read(child, 2, deadline - time.monotonic()) == b"ok"


def _read(child: subprocess.Popen, n: int, timeout: float) -> bytes:
    out, fd, deadline = b"", child.stdout.fileno(), time.monotonic() + timeout
    while len(out) < n:
        if not _wait(fd, select.POLLIN, deadline):
            return out
        try:
            chunk = os.read(fd, n - len(out))  # unbuffered: nothing read ahead that poll() would not see
        except OSError:
            return out
        if not chunk:  # the child died
            return out
        out += chunk
    return out


def _serve(probe: str, settings: dict[str, Any]) -> None:
    """The child: build the probe once; per payload, check it and answer."""
    # the answers get the original stdout to themselves: UCX logs to fd 1 (UCX_PROTO_INFO,
    # UCX_LOG_LEVEL), which would otherwise corrupt them and make every peer look hostile
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    module, _, name = probe.partition(":")
    check: Callable[[bytes], None] = getattr(importlib.import_module(module), name)(settings)
    stdin = sys.stdin.buffer
    answers.write(b"up")
    answers.flush()
    while (head := stdin.read(8)) and len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_MESSAGE:
            return
        try:
            check(stdin.read(n))
        except Exception:  # noqa: BLE001 - not a crash: the caller will see the same error, typed
            pass
        answers.write(b"ok")
        answers.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
