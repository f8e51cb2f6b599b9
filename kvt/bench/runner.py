"""Processes: each engine's target and initiator run in fresh processes.

Fresh (``spawn``) processes per engine because nixl's and ucxx's wheels
each bundle a libucx that must not meet in one process; this process
imports neither.  The target starts first and publishes what the initiator
needs to reach it (a handshake endpoint, NIXL metadata); the initiator then
runs every case of the plan and sends one row per case.  Native chatter of
the children goes to log files, whose tail is quoted when a child fails.
Every wait is bounded; children are killed in ``finally``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..errors import BackendUnavailable, ConfigError
from ..procs import child_of
from .plan import Plan
from .timing import measure

__all__ = ["EngineSpec", "Outcome", "run_engine", "check_configs", "KINDS"]

#: engine kind -> module with ``serve(spec, plan, ready, serve_until_stopped)``
#: (None: no target process) and ``open_engine(spec, plan, what ready published)``
KINDS = {"kvt": "kvt.bench.agent_engine", "memcpy": "kvt.bench.memcpy", "raw-nixl": "kvt.bench.raw_nixl"}
_MAX_LIFETIME = 6 * 3600.0  # a target outliving this was forgotten by its parent
_POLL = 0.001  # seconds between a target's polls


@dataclass(frozen=True)
class EngineSpec:
    """One thing under test (picklable: sent to its processes)."""

    name: str                     #: its rows' ``engine``
    kind: str                     #: a key of ``KINDS``
    config: Config | None = None  #: for kind ``kvt``: the backend and its options
    required: bool = True         #: asked for by name: unusable is an error, not a skip


@dataclass
class Outcome:
    spec: EngineSpec
    status: str = "ok"  #: ``ok``, ``skipped`` (not usable here) or ``error``
    reason: str = ""
    rows: list[dict] = field(default_factory=list)


def _redirect_output(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _serve_until_stopped(stop, parent: int, poll: Callable[[], object]) -> None:
    """The target's loop: ``poll`` (its notifications) every millisecond, as
    an engine's step loop would; that also progresses backends without a
    progress thread of their own.  Ends when told, or when the parent is gone.

    ``stop`` is a shared byte without a lock, not a ``multiprocessing.Event``:
    a target killed while waiting on an Event still counts as its sleeper,
    and ``Event.set()`` then waits for ever for it to wake."""
    deadline = time.monotonic() + _MAX_LIFETIME
    while True:
        time.sleep(_POLL)
        if stop.value or os.getppid() != parent or time.monotonic() >= deadline:
            return
        poll()


def _child(role: str, spec: EngineSpec, plan: Plan, info: Any, q, stop, log: str, parent: int) -> None:
    child_of(parent)
    _redirect_output(log)
    try:
        mod = importlib.import_module(KINDS[spec.kind])
        if role == "target":
            mod.serve(spec, plan, lambda payload: q.put(("ready", payload)),
                      lambda poll: _serve_until_stopped(stop, parent, poll))
            return
        engine = mod.open_engine(spec, plan, info)
        try:
            for case in plan.cases:
                q.put(("row", measure(engine, case, plan)))
        finally:
            engine.close()
        q.put(("done", None))
    except BackendUnavailable as e:
        q.put(("unusable", str(e)))
    except Exception as e:  # the process boundary: the parent reports it, as an engine failure
        q.put(("error", f"{role}: {type(e).__name__}: {e}"))


def _open_backend(config: Config, conn, parent: int) -> None:
    """Open and close the backend ``config`` names; send its ``ConfigError``'s message, or None."""
    child_of(parent)
    _redirect_output(os.devnull)  # native chatter
    from ..agent import Agent

    try:
        Agent(name="bench-check", config=config).close()
        conn.send(None)
    except ConfigError as e:
        conn.send(str(e))
    except Exception:  # noqa: BLE001 - not an option's fault: the run reports it where it happens
        conn.send(None)


def check_configs(specs: list[EngineSpec], timeout: float = 120.0) -> None:
    """``ConfigError`` now if a backend refuses its options (``-o``, ``--config``),
    rather than after the engines before it ran their whole plan: each
    backend opened once, each in a process of its own (see the module's doc),
    all at once.  A backend that cannot run here is left to the run to report."""
    ctx = mp.get_context("spawn")
    checks = []
    for spec in specs:
        if spec.kind == "kvt" and spec.config is not None:
            ours, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_open_backend, args=(spec.config, theirs, os.getpid()), daemon=True)
            p.start()
            theirs.close()
            checks.append((spec, p, ours))
    deadline = time.monotonic() + timeout
    try:
        for spec, p, conn in checks:
            try:
                refused = conn.recv() if conn.poll(max(0.0, deadline - time.monotonic())) else None
            except EOFError:  # it died: the run says how
                refused = None
            if refused is not None:
                raise ConfigError(f"backend {spec.config.backend!r}: {refused}")
    finally:
        for _spec, p, conn in checks:
            conn.close()
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)


def _tails(logs: dict[str, Path], lines: int = 12) -> str:
    """The last lines each child wrote, for an error message."""
    out = ""
    for name, path in logs.items():
        try:
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            continue
        if text:
            out += f"\n  [{name} output]\n    " + "\n    ".join(text)
    return out


class _Failed(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _receive(q, procs: list, logs: dict[str, Path], stall: float) -> tuple[str, Any]:
    """The next message; ``_Failed`` if a child reports failure, dies, or stays silent for ``stall`` s."""
    deadline = time.monotonic() + stall
    while True:
        try:
            kind, payload = q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                try:  # it may have reported why just before exiting
                    kind, payload = q.get(timeout=1.0)
                except queue.Empty:
                    p = dead[0]
                    raise _Failed("error", f"{p.name} process exited with code {p.exitcode}{_tails(logs)}")
            elif time.monotonic() > deadline:
                raise _Failed("error", f"no progress for {stall:g}s; processes killed{_tails(logs)}")
            else:
                continue
        if kind == "unusable":
            raise _Failed("skipped", payload)
        if kind == "error":
            raise _Failed("error", payload + _tails(logs))
        return kind, payload


def run_engine(spec: EngineSpec, plan: Plan, on_row: Callable[[dict], None] | None = None,
               stall: float | None = None) -> Outcome:
    """Run every case of ``plan`` for one engine; never raises for the
    engine's own failures (they are in the outcome)."""
    stall = stall or plan.timeout * (plan.warmup + plan.min_iters + 1) + plan.budget + 60
    serves = importlib.import_module(KINDS[spec.kind]).serve is not None
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Value("b", 0, lock=False)
    logdir = Path(tempfile.mkdtemp(prefix="kvt-bench-"))
    logs: dict[str, Path] = {}
    procs: list = []
    out = Outcome(spec)

    def start(role: str, info: Any) -> None:
        name = f"{spec.name} {role}"
        logs[name] = logdir / f"{role}.log"
        p = ctx.Process(target=_child, name=name, daemon=True,
                        args=(role, spec, plan, info, q, stop, str(logs[name]), os.getpid()))
        p.start()
        procs.append(p)

    try:
        info = None
        if serves:
            start("target", None)
            _kind, info = _receive(q, procs, logs, stall)
        start("initiator", info)
        while True:
            kind, payload = _receive(q, procs, logs, stall)
            if kind == "done":
                break
            out.rows.append(payload)
            if on_row:
                on_row(payload)
    except _Failed as f:
        out.status, out.reason = f.status, f.reason
    finally:
        stop.value = 1
        for p in procs:
            p.join(10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
        shutil.rmtree(logdir, ignore_errors=True)
    if out.status == "skipped" and spec.required:
        out.status = "error"
    return out
