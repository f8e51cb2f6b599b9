"""Transfers: READ and WRITE, one block and many (scatter/gather), within
one agent and with a peer in another process, on every memory kind; the
destination is compared byte for byte, including the bytes that must not
change."""

from __future__ import annotations

import numpy as np
from kvt.types import Descs, MemKind, Op

from ..fixtures import BackendFixtures, expect_done
from ..requirements import requires
from ._common import assert_bytes, destination, expected, seeds


class TransferTests(BackendFixtures):
    area = "transfers"
    block = 256
    nblocks = 64

    def _run(self, backend, op, lp, lidx, rp, ridx, wait_for):
        expect_done(backend, backend.transfer(op, lp, lidx, rp, ridx), wait_for)

    def test_single_block(self, backend, local_buffer, far_buffer, op, where, kind, wait_for):
        ns, fs = seeds(op)
        near = local_buffer(self.block, kind, ns)
        peer, far = far_buffer(self.block, kind, fs)
        lp, rp = backend.prep(None, near.blocks(self.block, [0])), backend.prep(peer, far.blocks(self.block, [0]))
        self._run(backend, op, lp, [0], rp, [0], wait_for)
        assert_bytes(destination(op, near, far).read(), expected(op, self.block, self.block, [0], [0]))

    def test_scatter_gather(self, backend, local_buffer, far_buffer, op, where, kind, wait_for):
        """40 of 64 blocks, in shuffled order on both sides; the other 24
        destination blocks stay untouched."""
        size, rng = self.block * self.nblocks, np.random.default_rng(7)
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, kind, ns), far_buffer(size, kind, fs)
        all_ids = np.arange(self.nblocks)
        lp, rp = backend.prep(None, near.blocks(self.block, all_ids)), backend.prep(peer, far.blocks(self.block, all_ids))
        near_ids, far_ids = rng.permutation(self.nblocks)[:40], rng.permutation(self.nblocks)[:40]
        self._run(backend, op, lp, near_ids, rp, far_ids, wait_for)
        assert_bytes(destination(op, near, far).read(), expected(op, size, self.block, near_ids, far_ids))

    def test_gather_into_contiguous(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """Odd blocks of one side to a contiguous run on the other, with
        prepped lists of different lengths addressed by index lists."""
        size = self.block * self.nblocks
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, MemKind.DRAM, ns), far_buffer(size, MemKind.DRAM, fs)
        odd = np.arange(1, self.nblocks, 2)
        lp = backend.prep(None, near.blocks(self.block, odd))             # 32 rows: near's odd blocks
        rp = backend.prep(peer, far.blocks(self.block, np.arange(16)))    # 16 rows: far's first blocks
        near_rows, far_rows = np.arange(16) * 2, np.arange(16)[::-1]
        self._run(backend, op, lp, near_rows, rp, far_rows, wait_for)
        assert_bytes(destination(op, near, far).read(),
                     expected(op, size, self.block, odd[near_rows], far_rows))

    def test_whole_lists(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """``None`` indices mean every row, paired in order."""
        size = self.block * 8
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, MemKind.DRAM, ns), far_buffer(size, MemKind.DRAM, fs)
        ids = np.arange(8)
        lp, rp = backend.prep(None, near.blocks(self.block, ids)), backend.prep(peer, far.blocks(self.block, ids[::-1]))
        self._run(backend, op, lp, None, rp, None, wait_for)
        assert_bytes(destination(op, near, far).read(), expected(op, size, self.block, ids, ids[::-1]))

    def test_several_regions_in_one_list(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """Blocks of three separately registered buffers (one per layer) in one
        list, base-major; block j of each near layer pairs with block 7-j of
        the same far layer."""
        layers, nb = 3, 8
        size = self.block * nb
        ns, fs = seeds(op)
        nears = [local_buffer(size, MemKind.DRAM, ns and ns + i) for i in range(layers)]
        made = [far_buffer(size, MemKind.DRAM, fs and fs + i) for i in range(layers)]
        peer, fars = made[-1][0], [b for _, b in made]  # the last metadata refresh covers all three
        ids = np.arange(nb)
        lp = backend.prep(None, Descs.from_blocks([b.addr for b in nears], self.block, ids))
        rp = backend.prep(peer, Descs.from_blocks([b.addr for b in fars], self.block, ids[::-1]))
        self._run(backend, op, lp, None, rp, None, wait_for)
        for i in range(layers):
            assert_bytes(nears[i].read(), fars[i].read().reshape(nb, self.block)[::-1], f"layer {i}")

    def test_multi_megabyte_block(self, backend, local_buffer, far_buffer, op, where, wait_for):
        size = 4 << 20
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, MemKind.DRAM, ns), far_buffer(size, MemKind.DRAM, fs)
        lp, rp = backend.prep(None, near.region()), backend.prep(peer, far.region())
        self._run(backend, op, lp, [0], rp, [0], wait_for)
        assert_bytes(destination(op, near, far).read(), expected(op, size, size, [0], [0]))

    @requires("READ", "WRITE")
    def test_write_then_read_back(self, backend, local_buffer, far_buffer, where, wait_for):
        size = self.block * 16
        src, back = local_buffer(size, seed=5), local_buffer(size)
        peer, far = far_buffer(size)
        ids = np.arange(16)
        sp, bp = backend.prep(None, src.blocks(self.block, ids)), backend.prep(None, back.blocks(self.block, ids))
        fp = backend.prep(peer, far.blocks(self.block, ids[::-1]))
        self._run(backend, Op.WRITE, sp, None, fp, None, wait_for)
        self._run(backend, Op.READ, bp, None, fp, None, wait_for)
        assert_bytes(back.read(), src.read())

