"""Cross-host: a backend that declares ``cross_host`` is run with its
``Capabilities.cross_host_options`` (the options that turn off its
same-host shortcuts: shared memory, process_vm_readv, UCX's shm
transports...), between this process and a peer process, so what it would
do between two hosts is what runs.  The report header says which options
these tests ran with."""

from __future__ import annotations

import numpy as np
from kvt.types import Op

from ..fixtures import BackendFixtures, expect_done
from ..requirements import requires
from ._common import CONTRACT_BLOCK, assert_bytes, scattered


@requires("cross_host")
class CrossHostTests(BackendFixtures):
    area = "cross-host"

    def test_cross_host_implies_remote(self, target):
        assert target.caps.remote, (
            f"{target.cls.__name__} declares cross_host but not remote; a peer on another host is a remote "
            "peer: declare remote=True, or cross_host=False if it reaches only agents of this host")

    def test_transfers_with_same_host_shortcuts_off(self, make_backend, local_buffer, spawn_peer, target, op,
                                                     wait_for):
        opts = dict(target.caps.cross_host_options)
        hint = (f"with cross_host_options {opts} (this backend's same-host shortcuts off), "
                "as between two hosts; declare cross_host=False if it cannot work without them")
        backend, peer = make_backend(**opts), spawn_peer(**opts)
        blk, n = CONTRACT_BLOCK // 2, 64
        size = 2 * n * blk
        near, far = local_buffer(size, owner=backend), peer.alloc(size)
        try:
            name = backend.add_remote(peer.metadata())
        except Exception as e:
            raise AssertionError(f"loading a peer process's metadata failed {hint}: {type(e).__name__}: {e}") from e
        every = np.arange(2 * n)
        lp, rp = backend.prep(None, near.blocks(blk, every)), backend.prep(name, far.blocks(blk, every))
        near_ids, far_ids = scattered(7, n)
        if op is Op.WRITE:
            data = near.fill(51)
        else:
            peer.fill_blocks(far.key, blk, every.tolist(), 52)
            data = far.read()
        notif = b"xhost" if target.caps.notifications else None
        handle = backend.transfer(op, lp, near_ids, rp, far_ids, notif=notif)
        expect_done(backend, handle, wait_for)
        want = np.zeros((2 * n, blk), np.uint8)
        dst_ids, src_ids = (far_ids, near_ids) if op is Op.WRITE else (near_ids, far_ids)
        want[dst_ids] = data.reshape(-1, blk)[src_ids]
        assert_bytes(far.read() if op is Op.WRITE else near.read(), want.ravel(), f"destination of a {op.value} {hint}")
        if notif is not None:
            assert peer.take_notifs(backend.agent_name, 1, wait_for) == [notif], (
                f"the {op.value}'s notification did not reach the peer {hint}")
