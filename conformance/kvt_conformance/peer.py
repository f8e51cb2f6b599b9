"""The peer agent the suites talk to: in another process, or in this one.

``PeerCore`` is the peer's side: a backend instance plus the commands a test
sends it (allocate and register a buffer, fill it, read it back, load a
peer's metadata, send or collect notifications...).  Run as
``python -m kvt_conformance.peer SPEC`` it serves those commands over kvt's
handshake channel (``kvt.handshake``), so a test drives a real separate
process; ``ProcessPeer`` is the test's client for it.  Backends that do not
declare ``remote`` get an in-process ``LocalPeer`` instead.

Nothing here can hang: every command has a timeout, the peer process exits
when its parent's end of stdin closes (the parent died), and after a
lifetime limit.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np
from kvt import errors
from kvt.agent import poll_until
from kvt.backend import Backend
from kvt.errors import InvalidArgument, KvtTimeoutError
from kvt.handshake import HandshakeServer, request
from kvt.types import Descs, MemKind

from .buffers import Buffer
from .target import Target, build

__all__ = ["freeze", "PeerCore", "ProcessPeer", "LocalPeer", "PeerPool", "RemoteBuffer", "PeerFailure",
           "shared_pool", "close_shared_pool"]

_READY = "KVT-PEER"
_LIFETIME = 1800.0      # seconds; a peer never outlives a stuck test run by much
_COMMAND_TIMEOUT = 30.0  # seconds for a command that does not wait on anything
_peer_ids = itertools.count(1)
#: run the peer on another test host (tests/multihost): the network namespace to start it in,
#: the address its channels bind to there, and JSON options that override the test's for it
_ENV_NETNS, _ENV_HOST, _ENV_OPTIONS = "KVT_CONFORMANCE_PEER_NETNS", "KVT_CONFORMANCE_PEER_HOST", \
    "KVT_CONFORMANCE_PEER_OPTIONS"



def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once the kernel reports every thread of it
    stopped (a signal is delivered asynchronously: right after ``kill`` the
    process may still run for a moment and answer, which would make a fault
    test lie; each thread stops on its own, the first one's state says
    nothing of the others)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(state in ("T", "t", "Z", "X") for state in _thread_states(pid)):
            return
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} did not stop within {timeout:g}s")


def _thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (``[]`` once it is gone)."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread exited meanwhile
    return states

class PeerFailure(AssertionError):
    """The peer process failed in a way that is not a kvt error (a test bug or
    a crashed peer); fails the test with the peer's message."""


class PeerCore:
    """A backend and the commands tests send it.  Buffers are named by key."""

    COMMANDS = ("info", "metadata", "alloc", "free", "fill_blocks", "contents", "add_remote",
                "remove_remote", "serve_metadata", "fetch_remote", "notify", "take_notifs",
                "other_senders", "snapshot_on_notif", "deregister", "reregister", "start_spin", "spin_result",
                "close_backend")

    def __init__(self, backend: Backend):
        self.backend = backend
        self._bufs: dict[str, tuple[Buffer, Any]] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._servers: list[HandshakeServer] = []
        self._keys = itertools.count(1)
        self._spin: tuple[threading.Event, list[bytes]] = (threading.Event(), [])

    def info(self) -> dict:
        return {"name": self.backend.agent_name, "pid": os.getpid()}

    def metadata(self) -> bytes:
        return self.backend.local_metadata()

    # -- memory -----------------------------------------------------------------

    def alloc(self, nbytes: int, kind: str = "DRAM", seed: int | None = None, register: bool = True,
              at: int | None = None) -> dict:
        """A zeroed (or ``pattern(seed)``-filled) buffer, registered unless told
        not to (``at``: DRAM at that address, see ``Buffer``)."""
        buf = Buffer(nbytes, kind, at)
        if seed is not None:
            buf.fill(seed)
        handle = self.backend.register(buf.region()) if register else None
        key = f"b{next(self._keys)}"
        self._bufs[key] = (buf, handle)
        return {"key": key, "addr": buf.addr, "nbytes": buf.nbytes, "device": buf.device, "kind": buf.kind.value}

    def free(self, key: str) -> None:
        buf, handle = self._bufs.pop(key)
        if handle is not None:
            self.backend.deregister(handle)

    def deregister(self, key: str, scribble: bool = False) -> None:
        """Deregister buffer ``key`` but keep its memory (so a test can see
        that nothing lands in, or is read from, memory no longer registered).
        With ``scribble``, overwrite it with 0xFF the instant ``deregister``
        returns: what a caller that freed the memory may put there next."""
        buf, handle = self._bufs[key]
        if handle is not None:
            self.backend.deregister(handle)
            self._bufs[key] = (buf, None)
            if scribble:
                buf.fill_byte(0xFF)

    def close_backend(self, scribble: bool = False) -> None:
        """Close the backend (buffers stay allocated, and readable with
        ``contents``).  With ``scribble``, overwrite every buffer with 0xFF the
        instant ``close`` returns: what a caller that freed them may put there
        next."""
        self.backend.close()
        if scribble:
            for buf, _ in self._bufs.values():
                buf.fill_byte(0xFF)
        self._bufs = {key: (buf, None) for key, (buf, _) in self._bufs.items()}

    def reregister(self, key: str, nbytes: int, offset: int = 0) -> None:
        """Register only ``nbytes`` from ``offset`` of buffer ``key`` instead of all of it."""
        buf, handle = self._bufs[key]
        if handle is not None:
            self.backend.deregister(handle)
            self._bufs[key] = (buf, None)
        region = Descs.from_regions(buf.addr + offset, nbytes, buf.device, buf.kind)
        self._bufs[key] = (buf, self.backend.register(region))

    def fill_blocks(self, key: str, block_len: int, ids: list[int], seed: int) -> None:
        self._bufs[key][0].fill_blocks(block_len, ids, seed)

    def contents(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._bufs[key][0].read(offset, length).tobytes()

    # -- peers ------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        return self.backend.add_remote(metadata)

    def remove_remote(self, name: str) -> None:
        self.backend.remove_remote(name)

    def serve_metadata(self) -> str:
        """Serve this agent's metadata through kvt's handshake; returns the endpoint."""
        server = HandshakeServer(lambda _request: self.backend.local_metadata(),
                                 os.environ.get(_ENV_HOST, "127.0.0.1")).start()
        self._servers.append(server)
        return server.endpoint

    def fetch_remote(self, endpoint: str, timeout: float = 10.0) -> str:
        """Fetch a peer's metadata through kvt's handshake and load it."""
        return self.backend.add_remote(request(endpoint, b"metadata", timeout))

    # -- notifications ----------------------------------------------------------

    def notify(self, peer: str, msgs: list[bytes]) -> None:
        for m in msgs:
            self.backend.notify(peer, m)

    def _pull(self) -> None:
        for sender, msgs in self.backend.get_notifs().items():
            self._inbox.setdefault(sender, []).extend(msgs)

    def take_notifs(self, sender: str, count: int, timeout: float) -> list[bytes]:
        """The first ``count`` messages from ``sender`` (fewer if ``timeout`` ran out)."""
        def enough() -> bool:
            self._pull()
            return len(self._inbox.get(sender, ())) >= count

        try:
            poll_until(enough, timeout, f"{count} notifications from {sender!r}")
        except KvtTimeoutError:
            pass
        got = self._inbox.get(sender, [])
        self._inbox[sender] = got[count:]
        return got[:count]

    def other_senders(self, sender: str) -> dict[str, int]:
        """How many messages wait from senders other than ``sender`` (for a
        failure message: notifications delivered under another name)."""
        self._pull()
        return {s: len(m) for s, m in self._inbox.items() if s != sender and m}

    def snapshot_on_notif(self, sender: str, msg: bytes, key: str, timeout: float) -> bytes | None:
        """Wait for ``msg`` from ``sender``; the moment it is seen, copy buffer
        ``key`` and return it (None if it never came)."""
        def seen() -> bool:
            self._pull()
            return msg in self._inbox.get(sender, ())

        try:
            poll_until(seen, timeout, f"notification {msg!r} from {sender!r}")
        except KvtTimeoutError:
            return None
        snap = self.contents(key)
        self._inbox[sender].remove(msg)
        return snap

    def start_spin(self, sender: str, msg: bytes, key: str, timeout: float, scribble: bool = False) -> None:
        """Start spinning on ``get_notifs`` (no sleep) in a thread, and return
        once it spins: the moment ``msg`` from ``sender`` appears it copies
        buffer ``key`` and, with ``scribble``, then overwrites the buffer with
        0xFF (what an owner may do once a READ of its memory was notified).
        ``spin_result`` collects the copy."""
        spinning, done = threading.Event(), threading.Event()
        self._spin = (done, [])
        threading.Thread(target=self._spin_on, args=(sender, msg, key, timeout, scribble, spinning, done),
                         daemon=True).start()
        spinning.wait(_COMMAND_TIMEOUT)

    def _spin_on(self, sender, msg, key, timeout, scribble, spinning, done) -> None:
        mem, out = self._bufs[key][0], self._spin[1]
        deadline = time.monotonic() + timeout
        try:
            spinning.set()
            while time.monotonic() < deadline:
                got = self.backend.get_notifs().get(sender, ())
                if msg in got:
                    out.append(mem.read().tobytes())
                    if scribble:
                        mem.write(np.full(mem.nbytes, 0xFF, np.uint8))
                    got = list(got)
                    got.remove(msg)
                if got:
                    self._inbox.setdefault(sender, []).extend(got)
                if out:
                    return
                time.sleep(0)  # no wait, but let other threads run: an in-process backend's worker needs the GIL
        finally:
            done.set()

    def spin_result(self, timeout: float) -> bytes | None:
        """What the spin ``start_spin`` started saw (None: ``msg`` never came)."""
        done, out = self._spin
        done.wait(timeout)
        return out[0] if out else None

    def close(self) -> None:
        for s in self._servers:
            s.close()
        self.backend.close()


# -- the peer process ------------------------------------------------------------

def _dispatch(core: PeerCore, stop: threading.Event, body: bytes) -> bytes:
    try:
        cmd, args, kwargs = msgspec.msgpack.decode(body)
        if cmd == "exit":
            stop.set()
            return msgspec.msgpack.encode({"ok": None})
        if cmd not in PeerCore.COMMANDS:
            raise InvalidArgument(f"unknown peer command {cmd!r}")
        return msgspec.msgpack.encode({"ok": getattr(core, cmd)(*args, **kwargs)})
    except Exception as e:  # reported to the test, which re-raises it
        return msgspec.msgpack.encode({"err": [type(e).__name__, str(e)]})


def _watch_parent(stop: threading.Event) -> None:
    """Stop when the parent closes our stdin (it exited or died)."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        stop.set()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    # our stdout pipe carries one line, for the parent; whatever the backend
    # prints goes to stderr (and cannot fill a pipe nobody reads)
    to_parent = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        backend = build(spec["target"], spec["name"], spec["options"])
    except errors.KvtError as e:
        print(f"KVT-PEER-ERROR {type(e).__name__}: {e}", file=to_parent, flush=True)
        return 3
    core = PeerCore(backend)
    stop = threading.Event()
    server = HandshakeServer(lambda body: _dispatch(core, stop, body), os.environ.get(_ENV_HOST, "127.0.0.1")).start()
    print(f"{_READY} {server.endpoint}", file=to_parent, flush=True)
    to_parent.close()
    threading.Thread(target=_watch_parent, args=(stop,), daemon=True).start()
    stop.wait(_LIFETIME)
    # a backend whose close() hangs must not keep the process alive
    threading.Timer(5.0, os._exit, args=(0,)).start()
    server.close()
    core.close()
    os._exit(0)


# -- the test's side ---------------------------------------------------------------

@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer in a peer, as the test sees it."""

    peer: Any
    key: str
    addr: int
    nbytes: int
    device: int
    kind: MemKind

    def region(self) -> Descs:
        return Descs.from_regions(self.addr, self.nbytes, self.device, self.kind)

    def blocks(self, block_len: int, ids: Any, offset: int = 0) -> Descs:
        return Descs.from_blocks(self.addr + offset, block_len, ids, device=self.device, kind=self.kind)

    def read(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        return np.frombuffer(self.peer.contents(self.key, offset, length), np.uint8)


def _raise_remote(peer: str, cmd: str, kind: str, msg: str):
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.KvtError):
        raise cls(f"(in peer {peer}) {msg}")
    raise PeerFailure(f"peer {peer} failed {cmd}: {kind}: {msg}")


def _python_path() -> str:
    """This process's import path, so the peer imports what the test imports
    (a backend class defined next to the tests, for example)."""
    return os.pathsep.join(dict.fromkeys(p for p in sys.path if p and os.path.exists(p)))


class ProcessPeer:
    """A peer agent in a child process, driven over kvt's handshake channel."""

    def __init__(self, target: Target, start_timeout: float = 60.0, name: str | None = None, **options: Any):
        self.target = target
        # a name already in use stands for that peer restarted (a new process)
        name = name or f"kvt-conformance-peer-{os.getpid()}-{next(_peer_ids)}"
        spec = {"target": target.spec, "name": name,
                "options": {**target.options, **options, **json.loads(os.environ.get(_ENV_OPTIONS) or "{}")}}
        env = {**os.environ, "PYTHONPATH": _python_path()}
        self._stderr = tempfile.TemporaryFile()
        netns = ["ip", "netns", "exec", os.environ[_ENV_NETNS]] if os.environ.get(_ENV_NETNS) else []
        self.proc = subprocess.Popen([*netns, sys.executable, "-m", "kvt_conformance.peer", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        try:
            self.endpoint = self._await_ready(start_timeout)
            info = self.call("info")
        except BaseException:
            self.kill()
            raise
        self.name, self.pid = info["name"], info["pid"]

    def _await_ready(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline, line = time.monotonic() + timeout, b""
        try:
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise PeerFailure(f"peer process did not start within {timeout:g}s{self._stderr_tail()}")
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise PeerFailure(f"peer process exited with code {self.proc.wait(5)} before it was "
                                      f"ready{self._stderr_tail()}")
                line += chunk
        finally:
            sel.close()
        text = line.decode().strip()
        if text.startswith("KVT-PEER-ERROR "):
            kind, _, msg = text[len("KVT-PEER-ERROR "):].partition(": ")
            _raise_remote("process", "start", kind, msg)
        if not text.startswith(_READY + " "):
            raise PeerFailure(f"unexpected peer output {text!r}{self._stderr_tail()}")
        return text.split()[1]

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        tail = self._stderr.read()[-3000:].decode(errors="replace").strip()
        return f"; its stderr ends with:\n{tail}" if tail else ""

    def call(self, cmd: str, *args: Any, timeout: float = _COMMAND_TIMEOUT, **kwargs: Any) -> Any:
        try:
            raw = request(self.endpoint, msgspec.msgpack.encode([cmd, list(args), kwargs]), timeout)
        except errors.HandshakeError as e:
            state = "alive" if self.alive() else f"dead (exit code {self.proc.returncode})"
            raise PeerFailure(f"peer {self.endpoint} ({state}) did not answer {cmd}: {e}"
                              f"{self._stderr_tail()}") from e
        reply = msgspec.msgpack.decode(raw)
        if "err" in reply:
            _raise_remote(getattr(self, "name", self.endpoint), cmd, *reply["err"])
        return reply["ok"]

    def __getattr__(self, cmd: str) -> Callable[..., Any]:
        if cmd not in PeerCore.COMMANDS:
            raise AttributeError(cmd)
        return lambda *a, **kw: self.call(cmd, *a, **kw)

    def take_notifs(self, sender: str, count: int, timeout: float) -> list[bytes]:
        return self.call("take_notifs", sender, count, timeout, timeout=timeout + _COMMAND_TIMEOUT)

    def snapshot_on_notif(self, sender: str, msg: bytes, key: str, timeout: float) -> bytes | None:
        return self.call("snapshot_on_notif", sender, msg, key, timeout, timeout=timeout + _COMMAND_TIMEOUT)

    def spin_result(self, timeout: float) -> bytes | None:
        return self.call("spin_result", timeout, timeout=timeout + _COMMAND_TIMEOUT)

    # -- process control (fault tests) -------------------------------------------

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Freeze the process (SIGSTOP): alive, but answering nothing."""
        freeze(self.proc.pid)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap (no clean-up runs in the peer)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipes()

    def close(self) -> None:
        """Ask the peer to exit; kill it if it does not within a few seconds."""
        if self.alive():
            try:
                self.call("exit", timeout=5)
            except (PeerFailure, errors.KvtError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self._stderr):
            if f is not None and not f.closed:
                f.close()


class LocalPeer:
    """A peer agent in this process (for backends that do not declare ``remote``)."""

    def __init__(self, target: Target, **options: Any):
        self.core = PeerCore(target.create("peer", **options))
        self.name, self.pid = self.core.backend.agent_name, os.getpid()

    def __getattr__(self, cmd: str) -> Callable[..., Any]:
        if cmd not in PeerCore.COMMANDS:
            raise AttributeError(cmd)
        return getattr(self.core, cmd)

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        self.core.close()


class PeerPool:
    """Process peers shared by every suite of a session (one per target and
    options), so a run spawns a few processes rather than one per class."""

    def __init__(self):
        self._peers: dict[str, ProcessPeer] = {}

    def get(self, target: Target) -> ProcessPeer:
        key = json.dumps([target.spec, target.options], sort_keys=True, default=str)
        peer = self._peers.get(key)
        if peer is None or not peer.alive():
            if peer is not None:
                peer.kill()
            peer = self._peers[key] = ProcessPeer(target)
        return peer

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()


_shared: PeerPool | None = None


def shared_pool() -> PeerPool:
    """The session's pool (closed by the pytest plugin at exit, or atexit)."""
    global _shared
    if _shared is None:
        _shared = PeerPool()
        atexit.register(close_shared_pool)
    return _shared


def close_shared_pool() -> None:
    global _shared
    if _shared is not None:
        _shared.close()
        _shared = None


if __name__ == "__main__":
    sys.exit(main(sys.argv))
