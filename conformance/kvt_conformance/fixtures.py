"""The fixtures every suite shares, as a mixin class (after fsspec's
``AbstractFixtures``).  A plugin's test module points them at its backend::

    class TestMyBackend(TransferTests):
        backend_target = "mybackend"          # entry-point name, or the class itself
        backend_options = {"timeout": 5}

Under ``pytest --pyargs kvt_conformance --kvt-backend=NAME`` the target
comes from the command line instead.  Any fixture here may be overridden in
a subclass.
"""

from __future__ import annotations

import json
from typing import Any, Callable, ClassVar, Mapping

import pytest
from kvt.agent import poll_until
from kvt.backend import Backend
from kvt.errors import KvtTimeoutError, UnknownPeer
from kvt.types import MemKind, Op, XferHandle, XferState

from . import peer as peers
from .buffers import Buffer
from .plugin import OPTIONS_KEY, TARGETS_KEY
from .requirements import MARKER, UNAVAILABLE, check
from .target import Target

__all__ = ["BackendFixtures", "PeerView", "settle", "settle_all", "expect_done"]


def settle(backend: Backend, handle: XferHandle, timeout: float) -> XferState:
    """Poll until the transfer leaves PROC; fail the test if it never does."""
    return settle_all(backend, [handle], timeout)[0]


def settle_all(backend: Backend, handles: list[XferHandle], timeout: float) -> list[XferState]:
    """Poll every transfer until none is PROC; all within one ``timeout``
    (a dead peer must fail every transfer queued to it in time, not one per timeout)."""
    states: dict[int, XferState] = {}

    def all_settled() -> bool:
        for i, h in enumerate(handles):
            if i not in states:
                s = backend.check_state(h)
                if not s.pending:
                    states[i] = s
        return len(states) == len(handles)

    try:
        poll_until(all_settled, timeout, "transfers")
    except KvtTimeoutError:
        pytest.fail(f"{len(handles) - len(states)} of {len(handles)} transfers still PROC after {timeout:g}s; "
                    "each must end within the backend's timeout")
    return [states[i] for i in range(len(handles))]


def expect_done(backend: Backend, handle: XferHandle, timeout: float) -> None:
    state = settle(backend, handle, timeout)
    assert state.done, f"transfer ended {state!r}, expected DONE"


class PeerView:
    """A test's handle on a peer: buffers it allocates come back as
    ``RemoteBuffer`` and are freed, and agents it loads are forgotten, at
    the end of the test (the peer itself may be shared)."""

    def __init__(self, peer: Any):
        self.raw = peer
        self._keys: list[str] = []
        self._loaded: list[str] = []

    @property
    def name(self) -> str:
        return self.raw.name

    def alloc(self, nbytes: int, kind: MemKind | str = MemKind.DRAM, seed: int | None = None,
              register: bool = True, at: int | None = None) -> peers.RemoteBuffer:
        d = self.raw.alloc(nbytes, MemKind(kind).value, seed, register, at)
        self._keys.append(d["key"])
        return peers.RemoteBuffer(self.raw, d["key"], d["addr"], d["nbytes"], d["device"], MemKind(d["kind"]))

    def load(self, backend: Backend) -> str:
        """Give the peer ``backend``'s metadata (so it can notify us)."""
        name = self.raw.add_remote(backend.local_metadata())
        self._loaded.append(name)
        return name

    def __getattr__(self, cmd: str) -> Callable[..., Any]:
        return getattr(self.raw, cmd)

    def cleanup(self) -> None:
        if not self.raw.alive():
            return
        for key in self._keys:
            self.raw.free(key)
        for name in self._loaded:
            try:
                self.raw.remove_remote(name)
            except UnknownPeer:
                pass


class _Backends:
    """``make_backend(**option_overrides)``: new instances, closed after the test
    (after the buffers registered with them are no longer used)."""

    def __init__(self, target: Target):
        self.target = target
        self.made: list[Backend] = []
        self.kept: list[Any] = []

    def __call__(self, **overrides: Any) -> Backend:
        b = self.target.create(**overrides)
        self.made.append(b)
        return b

    def keep(self, obj: Any) -> Any:
        self.kept.append(obj)
        return obj

    def close(self) -> None:
        """Close every instance (each one, even if another's close raises)."""
        failures = []
        for b in reversed(self.made):
            try:
                b.close()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others closed
                failures.append(e)
        self.kept.clear()
        if failures:
            raise failures[0]


class BackendFixtures:
    """Fixtures shared by every suite.  Set ``backend_target`` (and
    optionally ``backend_options``) in a subclass, or run under
    ``--kvt-backend``."""

    #: the backend under test: its entry-point name or its class
    backend_target: ClassVar[type[Backend] | str | None] = None
    #: options given to every instance (over kvt_conformance.target.DEFAULT_OPTIONS)
    backend_options: ClassVar[Mapping[str, Any]] = {}
    #: the capability area of the suite (for the report's table)
    area: ClassVar[str] = "other"

    @pytest.fixture
    def target(self, request: pytest.FixtureRequest) -> Target:
        config = request.config
        spec = self.backend_target or config.getoption("kvt_backend", None)
        if spec is None:
            pytest.skip("no backend to test: pass --kvt-backend=NAME, or set backend_target in a subclass")
        options = {**self.backend_options, **config.stash.get(OPTIONS_KEY, {})}
        key = (spec, json.dumps(options, sort_keys=True, default=str))
        tested = config.stash.setdefault(TARGETS_KEY, {})
        target = tested.get(key) or tested.setdefault(key, Target.resolve(spec, options))
        avail = target.availability()
        if not avail.usable:
            pytest.skip(f"{UNAVAILABLE}: backend {target.label}: {avail.reason}")
        return target

    @pytest.fixture(autouse=True)
    def _kvt_requirements(self, request: pytest.FixtureRequest, target: Target) -> None:
        for mark in request.node.iter_markers(MARKER):
            check(target.cls, *mark.args)

    # -- the capability axes a test runs over ---------------------------------------

    @pytest.fixture(params=list(MemKind), ids=lambda k: k.value)
    def kind(self, request: pytest.FixtureRequest, target: Target) -> MemKind:
        """Every memory kind; skipped where not declared or not present here."""
        check(target.cls, request.param)
        return request.param

    @pytest.fixture(params=list(Op), ids=lambda o: o.value)
    def op(self, request: pytest.FixtureRequest, target: Target) -> Op:
        check(target.cls, request.param)
        return request.param

    @pytest.fixture(params=["local", "remote"])
    def where(self, request: pytest.FixtureRequest, target: Target) -> str:
        """``local``: both sides in one agent; ``remote``: the far side in a peer process."""
        check(target.cls, request.param)
        return request.param

    # -- backends, buffers and peers ------------------------------------------------

    @pytest.fixture
    def make_backend(self, target: Target):
        backends = _Backends(target)
        try:
            yield backends
        finally:
            backends.close()

    @pytest.fixture
    def backend(self, make_backend: _Backends) -> Backend:
        return make_backend()

    @pytest.fixture
    def local_buffer(self, backend: Backend, make_backend: _Backends) -> Callable[..., Buffer]:
        """``local_buffer(nbytes, kind=DRAM, seed=None, register=True, owner=backend)``."""
        def make(nbytes: int, kind: MemKind = MemKind.DRAM, seed: int | None = None,
                 register: bool = True, owner: Backend | None = None) -> Buffer:
            buf = make_backend.keep(Buffer(nbytes, kind))
            if seed is not None:
                buf.fill(seed)
            if register:
                (owner or backend).register(buf.region())
            return buf
        return make

    @pytest.fixture
    def peer(self, target: Target):
        """Another agent of the same backend: in another process (shared by
        the session) when the backend declares ``remote``, else in this one."""
        if target.caps.remote:
            raw, owned = peers.shared_pool().get(target), False
        else:
            raw, owned = peers.LocalPeer(target), True
        view = PeerView(raw)
        try:
            yield view
            view.cleanup()
        finally:
            if owned:
                raw.close()

    @pytest.fixture
    def spawn_peer(self, target: Target):
        """``spawn_peer(name=None, **option_overrides)``: a dedicated peer
        process (one a test may stop or kill; ``name``: its agent's, to stand
        for a restarted peer); killed after the test."""
        made: list[peers.ProcessPeer] = []

        def spawn(**options: Any) -> PeerView:
            made.append(peers.ProcessPeer(target, **options))
            return PeerView(made[-1])

        try:
            yield spawn
        finally:
            for p in made:
                p.close()

    @pytest.fixture
    def new_peer(self, target: Target):
        """``new_peer(**option_overrides)``: a peer of the test's own, one it may
        close or load next to ``peer``: a process (as ``spawn_peer``) when the
        backend declares ``remote``, else another agent in this process.
        Closed after the test."""
        made: list[Any] = []

        def make(**options: Any) -> PeerView:
            made.append(peers.ProcessPeer(target, **options) if target.caps.remote
                        else peers.LocalPeer(target, **options))
            return PeerView(made[-1])

        try:
            yield make
        finally:
            for p in made:
                p.close()

    @pytest.fixture
    def far_buffer(self, where: str, backend: Backend, local_buffer, request: pytest.FixtureRequest):
        """``far_buffer(nbytes, kind, seed=None) -> (peer name or None, buffer)``:
        the other side of a transfer, in this agent (``where == "local"``) or
        in the peer (whose refreshed metadata is loaded)."""
        def make(nbytes: int, kind: MemKind = MemKind.DRAM, seed: int | None = None):
            if where == "local":
                return None, local_buffer(nbytes, kind, seed)
            p: PeerView = request.getfixturevalue("peer")
            buf = p.alloc(nbytes, kind, seed)
            return backend.add_remote(p.metadata()), buf
        return make

    @pytest.fixture
    def wait_for(self, target: Target) -> float:
        """Seconds a test waits for anything to settle: the backend's timeout plus slack."""
        return target.timeout + 5.0

