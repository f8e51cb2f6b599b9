"""Descriptors and prep: every accepted form of descriptor list, index
lists, and the 100,000-block lists engines move."""

from __future__ import annotations

import numpy as np
import pytest
from kvt.errors import InvalidHandle
from kvt.types import Descs, MemKind, Op

from ..buffers import Buffer
from ..fixtures import BackendFixtures, expect_done
from ..requirements import requires
from ._common import assert_bytes, destination, expected, seeds

HUGE = 100_000  # blocks in one list, as a long-context request across layers produces
SMALL = 32      # bytes per block in the huge lists, to keep buffers small


class DescriptorTests(BackendFixtures):
    area = "descriptors"

    def test_get_xfer_descs_forms(self, backend, make_backend):
        """Descs, an (n, 3) array, (addr, len, dev) tuples and buffers give the same list."""
        buf = make_backend.keep(Buffer(4096))
        want = Descs.from_regions(buf.addr, 4096)
        forms = [want, want.array, [(buf.addr, 4096, 0)], [buf.mem]]
        for form in forms:
            got = backend.get_xfer_descs(form)
            assert isinstance(got, Descs) and got == want, f"get_xfer_descs({type(form).__name__}) gave {got!r}"

    def test_get_xfer_descs_huge_list(self, backend):
        rows = np.column_stack([np.arange(HUGE, dtype=np.uint64) * 64 + 4096,
                                np.full(HUGE, 64, np.uint64), np.zeros(HUGE, np.uint64)])
        got = backend.get_xfer_descs(rows, MemKind.DRAM)
        assert len(got) == HUGE and np.array_equal(got.array, rows)

    @requires("local", "READ")
    def test_index_list_forms(self, backend, local_buffer, wait_for):
        """Python lists, int32 and int64 arrays, tuples, a repeated source row."""
        src, dst = local_buffer(8 * 64, seed=3), local_buffer(8 * 64)
        sp, dp = backend.prep(None, src.blocks(64, range(8))), backend.prep(None, dst.blocks(64, range(8)))
        pairs = [([0, 1], [7, 6]), (np.array([2], np.int32), np.array([5], np.int32)),
                 ((3, 4), (4, 3)), (np.array([1, 1], np.int64), np.array([0, 2], np.int64))]
        want = np.zeros((8, 64), np.uint8)
        have = src.read().reshape(8, 64)
        for d_idx, s_idx in pairs:  # READ into dst rows d_idx from src rows s_idx (both local)
            expect_done(backend, backend.transfer(Op.READ, dp, d_idx, sp, s_idx), wait_for)
            want[np.asarray(d_idx)] = have[np.asarray(s_idx)]
        assert_bytes(dst.read(), want)

    @requires("local")
    def test_hundred_thousand_blocks_local(self, backend, local_buffer, op, wait_for):
        self._huge(backend, local_buffer, None, op, wait_for)

    @requires("remote")
    def test_hundred_thousand_blocks_remote(self, backend, local_buffer, peer, op, wait_for):
        self._huge(backend, local_buffer, peer, op, wait_for)

    def _huge(self, backend, local_buffer, peer, op, wait_for):
        """Every other block of a 200,000-block buffer <-> 100,000 blocks in
        reverse order: 100,000 non-contiguous descriptors each side."""
        ns, fs = seeds(op)
        near = local_buffer(HUGE * SMALL, seed=ns)
        if peer is None:
            far, name = local_buffer(2 * HUGE * SMALL, seed=fs), None
        else:
            far = peer.alloc(2 * HUGE * SMALL, seed=fs)
            name = backend.add_remote(peer.metadata())
        far_ids, near_ids = np.arange(0, 2 * HUGE, 2), np.arange(HUGE)[::-1]
        lp = backend.prep(None, near.blocks(SMALL, near_ids))
        rp = backend.prep(name, far.blocks(SMALL, far_ids))
        expect_done(backend, backend.transfer(op, lp, None, rp, None), 3 * wait_for)
        n_dst, n_src = (near.nbytes, far.nbytes) if op is Op.READ else (far.nbytes, near.nbytes)
        want = expected(op, n_dst, SMALL, near_ids, far_ids, nbytes_src=n_src)
        assert_bytes(destination(op, near, far).read(), want)

    @requires("local", "READ")
    def test_prep_is_reusable(self, backend, local_buffer, wait_for):
        """One prepped list serves many transfers."""
        src, dst = local_buffer(16 * 64, seed=9), local_buffer(16 * 64)
        sp, dp = backend.prep(None, src.blocks(64, range(16))), backend.prep(None, dst.blocks(64, range(16)))
        for i in range(16):
            expect_done(backend, backend.transfer(Op.READ, dp, [i], sp, [15 - i]), wait_for)
        assert_bytes(dst.read(), src.read().reshape(16, 64)[::-1])

    def test_release_prep_twice(self, backend, local_buffer):
        buf = local_buffer(1024)
        h = backend.prep(None, buf.blocks(64, range(16)))
        backend.release(h)
        with pytest.raises(InvalidHandle):
            backend.release(h)
