"""Same-host process identity, for backends that watch their peers.

A peer's metadata carries ``host_id()`` and its pid's ``start_time``; a
backend that finds both equal here can watch that process directly (a dead
or zombie peer reads -1, and a reused pid has another start time).
"""

from __future__ import annotations

import ctypes
import os
import signal

from .errors import ConfigError
from .logs import log_to_stderr

__all__ = ["host_id", "start_time", "is_process", "child_of", "die_with_parent"]


def host_id() -> str:
    """Boot id plus pid and network namespaces: equal for two processes that
    share a host, see each other's pids and share one network view.  Two
    network namespaces count as two hosts (containers, test hosts): a peer's
    addresses mean something else there, so same-host shortcuts stay off."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}:{os.stat('/proc/self/ns/net').st_ino}"


def start_time(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks after boot; -1 if it is
    gone, a zombie, or not a process but a thread of one: ``/proc/<tid>``
    answers for every thread, and cma or ``/proc/<tid>/fd`` on a thread id
    act on its whole process, so a peer naming one of our threads would pass
    for another process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, *rest = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            tgid = next((int(line.split()[1]) for line in f if line.startswith("Tgid:")), -1)
    except (OSError, ValueError, IndexError):
        return -1
    return -1 if state in ("Z", "X") or tgid != pid else int(rest[18])


def is_process(pid: int, start: int) -> bool:
    """Whether ``pid`` is a live process started at ``start`` (a peer's
    metadata's claim): never for a start of -1, which every dead pid and
    every thread id reads."""
    return start >= 0 and start_time(pid) == start


_PR_SET_PDEATHSIG = 1


def child_of(parent: int) -> None:
    """First thing in a tool's child process: it dies with ``parent``
    (``die_with_parent``), leaves Ctrl-C to it, and logs as the tool does
    (``kvt.logs``).  A terminal sends SIGINT to the whole process group; the
    parent stops its children itself, so a child interrupted too would only
    print a traceback on the way."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        log_to_stderr()
    except ConfigError:  # the parent reported it (or is a library caller, whose logging is its own)
        pass


def die_with_parent(parent: int) -> None:
    """Have the kernel end this process (SIGTERM) when ``parent``, the
    process that started it, dies: a tool's children must not run on, or
    wait out their timeouts, after their parent was SIGKILLed.  Call it
    first thing in the child, from the thread that will run it, with the
    parent's pid as the parent saw it (a parent already gone is caught too)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the children's own deadlines still end them
        return
    if os.getppid() != parent:  # it died before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)
