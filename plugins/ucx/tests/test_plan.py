"""Message planning and the staging copies (no UCX involved)."""

from __future__ import annotations

import numpy as np
import pytest
from kvt_ucx.plan import gather, make_plan, scatter


def _rows(addrs, lens) -> np.ndarray:
    addrs, lens = np.broadcast_arrays(np.asarray(addrs, np.uint64), np.asarray(lens, np.uint64))
    return np.stack([addrs, lens, np.zeros_like(addrs)], axis=1)


def test_pairs_contiguous_on_both_sides_merge_into_one_run():
    l = _rows(1000 + np.arange(8) * 10, 10)
    r = _rows(50000 + np.arange(8) * 10, 10)
    p = make_plan(l, r, np.zeros(8, np.int64), sender_is_local=False, zcopy_min=1 << 20, stage_max=1 << 20)
    assert p.local.tolist() == [[1000, 80]] and p.remote.tolist() == [[50000, 80, 0]]
    assert p.bounds.tolist() == [0, 1] and p.staged.tolist() == [True]


def test_runs_do_not_merge_across_remote_registrations():
    l, r = _rows([0x1000, 0x1010], 16), _rows([0x9000, 0x9010], 16)
    p = make_plan(l, r, np.array([0, 1]), sender_is_local=False, zcopy_min=1 << 20, stage_max=1 << 20)
    assert len(p.local) == 2, "a run spanning two registrations would be refused by the target"


def test_long_runs_go_in_place_small_ones_are_packed_by_size():
    rng = np.random.default_rng(0)
    small = rng.permutation(1000)[:300] * 4096
    l = _rows(np.concatenate([small, [10 << 20]]), np.concatenate([np.full(300, 4096), [1 << 20]]))
    r = _rows(np.concatenate([rng.permutation(1000)[:300] * 4096, [40 << 20]]), l[:, 1])
    p = make_plan(l, r, np.zeros(301, np.int64), sender_is_local=True, zcopy_min=256 << 10, stage_max=256 << 10)
    sizes = p.sizes()
    assert p.staged.sum() == len(sizes) - 1 and not p.staged[-1]
    assert sizes[-1] == 1 << 20 and p.local[-1, 0] == 10 << 20
    assert (sizes[:-1] <= (256 << 10) + 4096).all() and sizes.sum() == 300 * 4096 + (1 << 20)
    # every pair is still paired with its own partner
    pairs = {(int(a), int(b)) for a, b in zip(l[:, 0], r[:, 0])}
    assert {(int(a), int(b)) for a, b in zip(p.local[:, 0], p.remote[:, 0])} == pairs


def test_device_memory_is_never_staged():
    l, r = _rows(np.arange(4) * 64, 16), _rows(np.arange(4) * 64, 16)
    p = make_plan(l, r, np.zeros(4, np.int64), sender_is_local=True, zcopy_min=1 << 20, stage_max=1 << 20,
                  in_place_only=True)
    assert not p.staged.any() and p.messages == 4


def test_zero_length_rows_are_dropped():
    p = make_plan(_rows([0x100, 0x200], [0, 8]), _rows([0x900, 0xa00], [0, 8]), np.zeros(2, np.int64),
                  sender_is_local=True, zcopy_min=64, stage_max=64)
    assert p.local.tolist() == [[0x200, 8]]


@pytest.mark.parametrize("sizes", [[4096], [512, 4096, 100, 4096]])
def test_gather_then_scatter_moves_every_row(sizes):
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    lens = np.resize(np.array(sizes, np.uint64), 40)
    slots = rng.permutation((1 << 20) // 8192)[:80].astype(np.uint64) * 8192 + rng.integers(0, 64, 80).astype(np.uint64)
    s_rows = np.stack([src.ctypes.data + slots[:40], lens], axis=1)
    d_rows = np.stack([dst.ctypes.data + slots[40:], lens], axis=1)
    stage = np.empty(int(lens.sum()), np.uint8)
    gather(s_rows, stage)
    scatter(d_rows, stage)
    for sa, da, n in zip(slots[:40].tolist(), slots[40:].tolist(), lens.tolist()):
        np.testing.assert_array_equal(dst[da:da + n], src[sa:sa + n])
    assert int(np.count_nonzero(dst)) <= int(lens.sum())


def test_4096_small_blocks_are_a_few_messages_not_4096():
    rng = np.random.default_rng(3)
    l = _rows(rng.permutation(8192)[:4096] * 4096, 4096)
    r = _rows(rng.permutation(8192)[:4096] * 4096 + (1 << 40), 4096)
    p = make_plan(l, r, np.zeros(4096, np.int64), sender_is_local=False, zcopy_min=256 << 10, stage_max=4 << 20)
    assert p.messages == 4 and p.staged.all()
