"""Transfers: READ and WRITE, one block and many (scatter/gather), within
one agent and with a peer in another process, on every memory kind; the
destination is compared byte for byte, including the bytes that must not
change."""

from __future__ import annotations

import numpy as np
from kvt.types import Descs, MemKind, Op

from ..fixtures import BackendFixtures, expect_done
from ..requirements import requires
from ..buffers import pattern
from ._common import FAR_SEED, NEAR_SEED, assert_bytes, destination, expected, seeds

#: one row longer than any plausible chunk (staging buffer, request, segment), of odd length
LONG_ROW = (64 << 20) + 4097
#: untouched bytes before and after it
GUARD = 4096
#: bytes read back from a peer per command (its channel caps a message at 16 MiB)
READ_CHUNK = 8 << 20


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

    def test_row_longer_than_any_chunk(self, backend, local_buffer, far_buffer, op, where, wait_for):
        """One row of ``LONG_ROW`` bytes (64 MiB and 4097: longer than any
        staging buffer, request or chunk a backend might cut a row into, and
        of odd length), a page into each buffer: every byte of it arrives, and
        the page before and after it stays untouched.  A backend that drops
        the tail of a long row must not report DONE."""
        size = LONG_ROW + 2 * GUARD
        ns, fs = seeds(op)
        near, (peer, far) = local_buffer(size, MemKind.DRAM, ns), far_buffer(size, MemKind.DRAM, fs)
        lp = backend.prep(None, Descs.from_regions(near.addr + GUARD, LONG_ROW, near.device))
        rp = backend.prep(peer, Descs.from_regions(far.addr + GUARD, LONG_ROW, far.device))
        self._run(backend, op, lp, [0], rp, [0], 2 * wait_for)
        src_seed = FAR_SEED if op is Op.READ else NEAR_SEED
        want = np.zeros(size, np.uint8)
        want[GUARD:GUARD + LONG_ROW] = pattern(src_seed, size)[GUARD:GUARD + LONG_ROW]
        dst = destination(op, near, far)
        for start in range(0, size, READ_CHUNK):  # a peer answers in messages of bounded size
            n = min(READ_CHUNK, size - start)
            assert_bytes(dst.read(start, n), want[start:start + n],
                         f"{op.value} destination bytes {start} to {start + n} (a row of {LONG_ROW} bytes from "
                         f"offset {GUARD}; the rest must stay zero)")

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

