"""Metadata: a round trip through kvt's handshake channel in both
directions, refresh after new registrations, re-adding a peer (live, given
up, restarted), remove_remote, and malformed metadata rejected with a typed
error that leaves the backend usable."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import msgspec
import numpy as np
import pytest
from kvt.errors import InvalidDescriptor, KvtError, TransferError, UnknownPeer, WireError
from kvt.handshake import HandshakeServer, request
from kvt.types import Op
from kvt.wire import AgentInfo, encode

from ..buffers import pattern
from ..fixtures import BackendFixtures, expect_done, settle, settle_all
from ..peer import PeerFailure
from ..requirements import requires
from ._common import assert_bytes

#: bytes of the buffers of the remove_remote tests
BLOCK_SIZE = 4096
#: where a peer maps the memory a restart test prepares (far from where Linux puts a process's own)
_FIXED = 0x2F0000000000

_MALFORMED = {
    "empty": lambda md: b"",
    "one-byte": lambda md: b"\x00",
    "random": lambda md: np.random.default_rng(3).integers(0, 256, 257, dtype=np.uint8).tobytes(),
    "truncated": lambda md: md[: len(md) // 2],
    "another-message": lambda md: encode(AgentInfo(name="x", backend="x", metadata=b"")),
}


def _hostile(value: Any) -> list[Any]:
    """Values a hostile peer might put where ``value`` was: other types,
    bounds of integers, cut, padded and oversized bytes and strings."""
    if isinstance(value, bool):
        return [not value, 2, "true"]
    if isinstance(value, int):
        return [-1, 0, (1 << 63) - 1, (1 << 64) - 1, "0", None, 0.5]
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value)
        return [b"", value[:-1], value + b"\0", value[: len(value) // 2], value * 64, b"\xff" * len(value), "x", 0]
    if isinstance(value, str):
        return ["", "x" * 65536, value + "\0", 0, None]
    if isinstance(value, list):
        return [[], value * 2, [None], "x"]
    if isinstance(value, dict):
        return [{}, {"x": None}, []]
    return [0, "x"]


def _mutations(metadata: bytes) -> Iterator[tuple[str, bytes]]:
    """``metadata`` (a msgpack map, as kvt wire messages are) re-encoded with
    one field, at any depth, replaced by each of ``_hostile``'s values."""
    root = msgspec.msgpack.decode(metadata)

    def walk(container: Any, key: Any, path: str, depth: int) -> Iterator[tuple[str, bytes]]:
        value = container[key]
        for bad in _hostile(value):
            container[key] = bad
            yield f"{path}={bad!r:.40}", msgspec.msgpack.encode(root)
        container[key] = value
        if depth < 3 and isinstance(value, (dict, list)):
            for k in list(value)[:4] if isinstance(value, dict) else range(min(len(value), 2)):
                yield from walk(value, k, f"{path}.{k}", depth + 1)

    for k in list(root):
        yield from walk(root, k, str(k), 1)


class MetadataTests(BackendFixtures):
    area = "metadata"

    def _first_op(self, target) -> Op:
        return next(o for o in (Op.READ, Op.WRITE) if o in target.caps.ops)

    def _check_path(self, backend, local_buffer, peer, target, wait_for):
        """A transfer to a new buffer of the peer (its metadata reloaded) moves the right bytes."""
        op = self._first_op(target)
        far = peer.alloc(1024, seed=4 if op is Op.READ else None)
        name = backend.add_remote(peer.metadata())
        near = local_buffer(1024, seed=None if op is Op.READ else 4)
        lp, rp = backend.prep(None, near.blocks(256, range(4))), backend.prep(name, far.blocks(256, range(4)))
        expect_done(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        assert_bytes(near.read(), far.read())

    def test_local_metadata_is_bytes(self, backend):
        md = backend.local_metadata()
        assert isinstance(md, bytes) and md

    def test_round_trip_through_handshake(self, backend, local_buffer, peer, target, wait_for):
        endpoint = peer.serve_metadata()
        name = backend.add_remote(request(endpoint, b"metadata", wait_for))
        assert name == peer.name
        self._check_path(backend, local_buffer, peer, target, wait_for)

    def test_peer_loads_ours_through_handshake(self, backend, peer, wait_for):
        with HandshakeServer(lambda _req: backend.local_metadata()) as server:
            assert peer.fetch_remote(server.endpoint, wait_for) == backend.agent_name
        peer.remove_remote(backend.agent_name)

    def test_reload_refreshes_registrations(self, backend, peer):
        """Memory the peer registers after we loaded its metadata becomes
        reachable when we load it again (and not before)."""
        backend.add_remote(peer.metadata())
        late = peer.alloc(1024)
        with pytest.raises(InvalidDescriptor):
            backend.prep(peer.name, late.blocks(256, [0]))
        assert backend.add_remote(peer.metadata()) == peer.name
        backend.prep(peer.name, late.blocks(256, [0]))

    def test_readding_unchanged_metadata_leaves_transfers_in_flight_alone(self, make_backend, local_buffer, peer,
                                                                          spawn_peer, target, op, wait_for):
        """Re-adding a live peer's metadata, unchanged, changes nothing:
        transfers in flight to it end DONE with the right bytes and new ones
        work (``kvt.Agent.reconnect`` re-adds unchanged metadata when one
        transfer failed; that must not cost the others).  A peer process is
        stopped meanwhile, both sides built with ``cross_host_options`` so the
        transfers really wait for it, and resumed by a timer (``add_remote``
        may wait for it, bounded by the timeout); an in-process peer gets
        enough transfers that most are still queued."""
        remote = target.caps.remote
        opts = dict(target.caps.cross_host_options) if remote else {}
        backend = make_backend(**opts)
        other = spawn_peer(**opts) if remote else peer
        n, block = (8, 64 << 10) if remote else (64, 1 << 20)
        far = other.alloc(n * block, seed=3 if op is Op.READ else None)
        md = other.metadata()
        name = backend.add_remote(md)
        near = local_buffer(n * block, seed=None if op is Op.READ else 3, owner=backend)
        lp, rp = backend.prep(None, near.blocks(block, range(n))), backend.prep(name, far.blocks(block, range(n)))
        resume = threading.Timer(1.0, other.resume) if remote else None
        if remote:
            other.stop()
        try:
            posted = [backend.transfer(op, lp, [i], rp, [i]) for i in range(n)]
            if remote:
                resume.start()
            assert backend.add_remote(md) == name
            states = settle_all(backend, posted, wait_for)
        finally:
            if remote:
                resume.cancel()
                other.resume()
        failed = [s for s in states if not s.done]
        assert not failed, (f"{len(failed)} of {n} transfers in flight when the peer's unchanged metadata was "
                            f"re-added ended {failed[0]!r}; re-adding the metadata of a live peer must leave "
                            "its connection and transfers alone")
        assert_bytes(near.read(), far.read(), "transfers in flight across the re-add")
        if op is Op.READ:  # new contents at the source, so the second transfer has to move them
            other.fill_blocks(far.key, block, list(range(n)), 4)
        else:
            near.fill(4)
        expect_done(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        assert_bytes(near.read(), far.read(), "a transfer posted after the re-add")

    @requires("remote")
    def test_readding_a_given_up_peer_reconnects_it(self, make_backend, local_buffer, spawn_peer, target, wait_for):
        """A peer that stopped answering past the timeout may be given up (its
        transfer ends ERR, later ones fail at once); re-adding its metadata,
        unchanged, once it answers again resets it: transfers work again."""
        opts = dict(target.caps.cross_host_options)
        backend = make_backend(timeout=2.0, **opts)
        victim = spawn_peer(**opts)
        op = self._first_op(target)
        far = victim.alloc(1 << 18, seed=5 if op is Op.READ else None)
        md = victim.metadata()
        name = backend.add_remote(md)
        near = local_buffer(1 << 18, seed=None if op is Op.READ else 5, owner=backend)
        lp, rp = backend.prep(None, near.blocks(4096, range(64))), backend.prep(name, far.blocks(4096, range(64)))
        victim.stop()
        try:
            state = settle(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        finally:
            victim.resume()
        if state.done:
            pytest.skip(f"the {op.value} completed with the peer stopped, even with {opts}: nothing stalled")
        assert backend.add_remote(md) == name
        expect_done(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        assert_bytes(near.read(), far.read(), "a transfer after re-adding a given-up peer")

    @requires("remote")
    def test_new_incarnation_replaces_the_peer(self, make_backend, local_buffer, spawn_peer, target, wait_for):
        """Metadata of a restarted peer (the same agent name, a new process)
        replaces the old one: a transfer in flight to the old process ends
        ERR, and new transfers reach the new process."""
        opts = dict(target.caps.cross_host_options)
        backend = make_backend(**opts)
        old = spawn_peer(**opts)
        op = self._first_op(target)
        obuf = old.alloc(1 << 18, seed=6)
        name = backend.add_remote(old.metadata())
        near = local_buffer(1 << 18, seed=None if op is Op.READ else 7, owner=backend)
        lp, orp = backend.prep(None, near.blocks(4096, range(64))), backend.prep(name, obuf.blocks(4096, range(64)))
        new = spawn_peer(name=name, **opts)
        nbuf = new.alloc(1 << 18, seed=8 if op is Op.READ else None)
        old.stop()
        try:
            h = backend.transfer(op, lp, None, orp, None)
            assert backend.add_remote(new.metadata()) == name
            state = backend.wait(h, target.timeout / 2)
        finally:
            old.resume()
        assert not state.pending, (f"the {op.value} to the old process was still PROC {target.timeout / 2:g}s after "
                                   "its new incarnation's metadata was added; it must end ERR then, not when "
                                   "the old process misses the timeout")
        if state.failed:  # DONE: it completed before the re-add (a same-host shortcut read the stopped process)
            assert isinstance(state.cause, TransferError), f"ERR cause {state.cause!r} is not a TransferError"
        expect_done(backend, backend.transfer(op, lp, None, backend.prep(name, nbuf.blocks(4096, range(64))), None),
                    wait_for)
        assert_bytes(near.read(), nbuf.read(), "a transfer to the new incarnation")

    @requires("remote")
    @pytest.mark.parametrize("op", [Op.READ, Op.WRITE], ids=lambda o: o.value)
    def test_a_prep_from_before_a_restart_reaches_only_what_the_new_process_registered(
            self, make_backend, local_buffer, spawn_peer, target, wait_for, op):
        """A remote prep made against a peer's first process and used after its
        restart (same name; the new process's metadata added) reaches only
        memory the new process registered.  Here the new process has memory
        at the prepped addresses but registered other memory: the transfer
        raises ``KvtError`` or ends ERR, and no byte moves either way (a
        same-host shortcut trusting the first process's check reads or
        writes the new process's memory)."""
        if op not in target.caps.ops:
            pytest.skip(f"{op.value} is not declared")
        backend = make_backend()
        old = spawn_peer()
        try:
            obuf = old.alloc(1 << 16, seed=11, at=_FIXED)
        except PeerFailure as e:
            if "OSError" not in str(e):
                raise
            pytest.skip(f"the peer cannot map memory at {_FIXED:#x} (taken, or not Linux): {e}")
        name = backend.add_remote(old.metadata())
        near = local_buffer(1 << 16, seed=12, owner=backend)
        lp, rp = backend.prep(None, near.blocks(4096, range(16))), backend.prep(name, obuf.blocks(4096, range(16)))
        expect_done(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        old.kill()
        new = spawn_peer(name=name)
        unregistered = new.alloc(1 << 16, seed=13, at=_FIXED, register=False)
        new.alloc(1 << 16, seed=14)  # what it registers
        near.fill(12)
        assert backend.add_remote(new.metadata()) == name
        try:
            state = settle(backend, backend.transfer(op, lp, None, rp, None), wait_for)
        except KvtError:
            state = None  # refused before any byte moved: fine
        assert state is None or state.failed, (
            f"a {op.value} through a prep of the peer's first process ended {state} after its restart, with rows "
            "its new process never registered")
        assert_bytes(near.read(), pattern(12, 1 << 16), f"our memory after the refused {op.value}")
        assert_bytes(unregistered.read(), pattern(13, 1 << 16), f"the new process's unregistered memory after the "
                     f"refused {op.value}")

    @pytest.mark.parametrize("how", list(_MALFORMED))
    def test_malformed_metadata(self, backend, local_buffer, peer, target, wait_for, how):
        bad = _MALFORMED[how](peer.metadata())
        with pytest.raises(WireError):
            backend.add_remote(bad)
        # state intact: the real metadata still loads and works
        self._check_path(backend, local_buffer, peer, target, wait_for)

    def test_malformed_metadata_is_not_a_peer(self, backend):
        with pytest.raises(WireError):
            backend.add_remote(b"\x93not-metadata")
        with pytest.raises(UnknownPeer):
            backend.remove_remote("not-metadata")

    def test_remove_remote(self, backend, peer):
        name = backend.add_remote(peer.metadata())
        buf = peer.alloc(1024)
        backend.add_remote(peer.metadata())
        backend.remove_remote(name)
        with pytest.raises(UnknownPeer):
            backend.prep(name, buf.blocks(256, [0]))
        with pytest.raises(UnknownPeer):
            backend.remove_remote(name)
        assert backend.add_remote(peer.metadata()) == name
        backend.prep(name, buf.blocks(256, [0]))

    def test_a_prep_from_before_remove_remote_moves_nothing(self, backend, local_buffer, peer, op, wait_for):
        """A remote prep made before ``remove_remote`` names a peer that is no
        longer loaded: a transfer with it is the unknown peer's typed error
        before any byte moves (``transfer`` raises a kvt error, ``UnknownPeer``
        at best, or the transfer ends ERR), never DONE, nothing copied either
        way."""
        near = local_buffer(BLOCK_SIZE, seed=51 if op is Op.WRITE else None)
        far = peer.alloc(BLOCK_SIZE, seed=52 if op is Op.READ else None)
        before_near, before_far = near.read(), far.read()
        name = backend.add_remote(peer.metadata())
        lp, rp = backend.prep(None, near.blocks(256, range(BLOCK_SIZE // 256))), \
            backend.prep(name, far.blocks(256, range(BLOCK_SIZE // 256)))
        backend.remove_remote(name)
        try:
            handle = backend.transfer(op, lp, None, rp, None)
        except KvtError:
            handle = None
        if handle is not None:
            state = settle(backend, handle, wait_for)
            assert state.failed, (
                f"a {op.value} with a prep of peer {name!r} made before remove_remote({name!r}) ended {state!r}; "
                "a peer no longer loaded is unknown: raise UnknownPeer from transfer (or end it ERR) before any "
                "byte moves")
            assert isinstance(state.cause, TransferError), f"ERR cause {state.cause!r} is not a TransferError"
        assert_bytes(near.read(), before_near, "this agent's memory after a transfer with a removed peer "
                     "(nothing may move)")
        assert_bytes(far.read(), before_far, "the removed peer's memory after a transfer with it (nothing may move)")

    @pytest.mark.parametrize("bad", ["", "x" * 257], ids=["empty", "257-chars"])
    def test_bad_peer_name_is_refused(self, backend, peer, bad):
        """Metadata naming its agent ``""`` or a name of over 256 characters
        (every top-level field that held the peer's name replaced) is
        malformed: ``add_remote`` raises ``WireError`` and loads no peer (a
        peer called "" is one no error, log line or notification sender can
        name; names are bounded so that every message naming a peer is).
        The real metadata still loads afterwards."""
        md = peer.metadata()
        try:
            fields = msgspec.msgpack.decode(md)
        except msgspec.DecodeError:
            fields = None
        names = [k for k, v in fields.items() if v == peer.name] if isinstance(fields, dict) else []
        if not names:
            pytest.skip("this backend's metadata is not a msgpack map with a field holding the agent's name")
        fields.update(dict.fromkeys(names, bad))
        with pytest.raises(WireError):
            backend.add_remote(msgspec.msgpack.encode(fields))
        with pytest.raises(UnknownPeer):
            backend.remove_remote(bad)
        assert backend.add_remote(md) == peer.name

    def test_hostile_metadata_fields(self, backend, local_buffer, peer, target, wait_for):
        """A peer's metadata with one field replaced (wrong type, cut, padded,
        oversized, out of range), for every field: ``add_remote`` raises a kvt
        error or loads it, and a transfer with what it loaded raises a kvt
        error or settles; nothing else escapes, nothing hangs, and the real
        metadata still works afterwards."""
        op = self._first_op(target)
        far = peer.alloc(1024, seed=5)
        near = local_buffer(1024)
        md = peer.metadata()
        try:
            fields = msgspec.msgpack.decode(md)
        except msgspec.DecodeError:
            fields = None
        if not isinstance(fields, dict):
            pytest.skip("this backend's metadata is not a msgpack map: only the malformed-bytes cases apply")
        escaped, stuck = [], []
        for what, bad in _mutations(md):
            try:
                name = backend.add_remote(bad)
                lp, rp = backend.prep(None, near.blocks(256, range(4))), backend.prep(name, far.blocks(256, range(4)))
                handle = backend.transfer(op, lp, None, rp, None)
                if backend.wait(handle, wait_for).pending:
                    stuck.append(what)
                backend.release(handle)
            except KvtError:
                pass
            except Exception as e:  # noqa: BLE001 - collected: the failure lists every one
                escaped.append(f"{what}: {type(e).__name__}: {e}")
        assert not escaped, (f"{len(escaped)} hostile metadata fields made a non-kvt error escape (add_remote "
                             "must raise WireError for malformed metadata; only kvt errors may escape): "
                             + "; ".join(escaped[:5]))
        assert not stuck, (f"transfers with {len(stuck)} hostile metadata fields loaded were still PROC after "
                           f"{wait_for:g}s (each must settle within the backend's timeout): {stuck[:5]}")
        self._check_path(backend, local_buffer, peer, target, wait_for)
