"""Owner-side checks: the owner of memory serves only what it has
registered *now*.  Initiator-side checks at ``prep`` are a courtesy; this
suite goes around them with stale metadata (the owner deregisters after the
initiator loaded its metadata and prepped), so a backend whose target
trusts the initiator's word is seen moving bytes of memory that is no
longer registered."""

from __future__ import annotations

import numpy as np
from kvt.errors import RemoteRejected
from kvt.types import Op

from ..fixtures import BackendFixtures, settle
from ..requirements import requires
from ._common import assert_bytes

#: what Capabilities.owner_check may say
OWNER_CHECKS = ("server", "transport")


class OwnerCheckTests(BackendFixtures):
    area = "owner checks"
    block = 4096
    nblocks = 64

    @requires("remote")
    def test_declares_how_the_owner_checks(self, target):
        how = target.caps.owner_check
        assert how in OWNER_CHECKS, (
            f"{target.cls.__name__}.capabilities.owner_check is {how!r}, expected one of {OWNER_CHECKS}: "
            "declare 'server' if a target-side server checks every request against its registrations and "
            "answers RemoteRejected, or 'transport' if the transport's remote keys exist only for registered "
            "memory (see docs/plugin-guide.md, 'The owner checks')")

    def test_stale_metadata_is_refused(self, backend, local_buffer, peer, op, wait_for):
        """The peer deregisters after we loaded its metadata and prepped: the
        transfer must end in ERR with ``RemoteRejected``, and nothing moves."""
        size = self.block * self.nblocks
        ids = np.arange(self.nblocks)
        near = local_buffer(size, seed=41 if op is Op.WRITE else None)
        far = peer.alloc(size, seed=42 if op is Op.READ else None)
        before_near, before_far = near.read(), far.read()
        name = backend.add_remote(peer.metadata())
        lp, rp = backend.prep(None, near.blocks(self.block, ids)), backend.prep(name, far.blocks(self.block, ids))
        peer.deregister(far.key)  # the memory stays; only its registration goes
        try:
            handle = backend.transfer(op, lp, None, rp, None)
        except RemoteRejected:
            handle = None  # refused before posting: as good
        if handle is not None:
            state = settle(backend, handle, wait_for)
            assert state.failed and isinstance(state.cause, RemoteRejected), (
                f"a {op.value} of memory the peer deregistered after we loaded its metadata ended {state!r}; "
                "expected ERR with RemoteRejected: the owner must check every request against what it has "
                "registered now (not what its metadata said) and refuse the rest with RemoteRejected")
        assert_bytes(near.read(), before_near, "this agent's memory after the refused transfer (nothing may move)")
        assert_bytes(far.read(), before_far, "the peer's memory after the refused transfer (nothing may move)")
