"""Metadata: a round trip through kvt's handshake channel in both
directions, refresh after new registrations, remove_remote, and malformed
metadata rejected with a typed error that leaves the backend usable."""

from __future__ import annotations

import numpy as np
import pytest
from kvt.errors import InvalidDescriptor, UnknownPeer, WireError
from kvt.handshake import HandshakeServer, request
from kvt.types import Op
from kvt.wire import AgentInfo, encode

from ..fixtures import BackendFixtures, expect_done
from ._common import assert_bytes

_MALFORMED = {
    "empty": lambda md: b"",
    "one-byte": lambda md: b"\x00",
    "random": lambda md: np.random.default_rng(3).integers(0, 256, 257, dtype=np.uint8).tobytes(),
    "truncated": lambda md: md[: len(md) // 2],
    "another-message": lambda md: encode(AgentInfo(name="x", backend="x", metadata=b"")),
}


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
