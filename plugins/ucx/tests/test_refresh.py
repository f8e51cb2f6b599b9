"""ucx: re-adding the metadata of the same process after it registered more
memory refreshes what it offers and leaves transfers in flight to it alone
(they finish on the old endpoint and keys, which are freed afterwards)."""

import threading

import kvt_conformance as kc
from kvt.types import Op
from kvt_conformance.fixtures import expect_done, settle_all
from kvt_conformance.suites._common import assert_bytes


class TestRefresh(kc.BackendFixtures):
    backend_target = "ucx"
    backend_options = {"timeout": 5.0, "ucx": {"NET_DEVICES": "lo"}}

    def test_refreshed_metadata_of_the_same_process_leaves_transfers_in_flight_alone(
            self, make_backend, local_buffer, spawn_peer, target, wait_for):
        opts = dict(target.caps.cross_host_options)  # over TCP: a stopped peer really stalls them
        backend = make_backend(**opts)
        other = spawn_peer(**opts)
        n, block = 8, 64 << 10
        far = other.alloc(n * block, seed=3)
        name = backend.add_remote(other.metadata())
        near = local_buffer(n * block, owner=backend)
        lp, rp = backend.prep(None, near.blocks(block, range(n))), backend.prep(name, far.blocks(block, range(n)))
        late = other.alloc(block, seed=5)  # registered after we loaded its metadata: the metadata changes
        md = other.metadata()
        resume = threading.Timer(1.0, other.resume)
        other.stop()
        try:
            posted = [backend.transfer(Op.READ, lp, [i], rp, [i]) for i in range(n)]
            resume.start()
            assert backend.add_remote(md) == name
            states = settle_all(backend, posted, wait_for)
        finally:
            resume.cancel()
            other.resume()
        failed = [s for s in states if not s.done]
        assert not failed, f"{len(failed)} of {n} transfers in flight across the refresh ended {failed[0]!r}"
        assert_bytes(near.read(), far.read(), "transfers in flight across the refresh")
        assert not backend._retired, "the replaced connection outlived its transfers"
        # what it registered late is reachable now, and the prep made before the refresh still works
        expect_done(backend, backend.transfer(Op.READ, lp, [0], backend.prep(name, late.blocks(block, [0])), [0]),
                    wait_for)
        assert_bytes(near.read(0, block), late.read(), "the memory registered late")
        expect_done(backend, backend.transfer(Op.READ, lp, None, rp, None), wait_for)
        assert_bytes(near.read(), far.read(), "a transfer through the prep made before the refresh")

    def test_remove_remote_ends_what_is_in_flight_on_a_replaced_connection(
            self, make_backend, local_buffer, spawn_peer, target, wait_for):
        opts = dict(target.caps.cross_host_options)
        backend = make_backend(**opts)
        other = spawn_peer(**opts)
        far = other.alloc(1 << 16, seed=3)
        name = backend.add_remote(other.metadata())
        near = local_buffer(1 << 16, owner=backend)
        lp, rp = backend.prep(None, near.blocks(4096, range(16))), backend.prep(name, far.blocks(4096, range(16)))
        other.alloc(4096)
        md = other.metadata()
        other.stop()
        try:
            posted = [backend.transfer(Op.READ, lp, [i], rp, [i]) for i in range(16)]
            assert backend.add_remote(md) == name  # the old connection is retired, its transfers still in flight
            backend.remove_remote(name)
            states = [backend.check_state(h) for h in posted]  # ended by remove_remote, not by their timeout
        finally:
            other.resume()
        assert all(s.failed for s in states), states
        assert not backend._retired
