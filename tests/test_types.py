import pickle

import numpy as np
import pytest

from kvt import Descs, MemKind, XferState
from kvt.errors import InvalidArgument, InvalidDescriptor, TransferError
from kvt.types import Status, as_index


def test_from_blocks_is_base_major_and_exact():
    d = Descs.from_blocks([1000, 5000], 16, [0, 3], stride=32)
    assert d.array.tolist() == [[1000, 16, 0], [1096, 16, 0], [5000, 16, 0], [5096, 16, 0]]


def test_from_blocks_100k_blocks_matches_formula():
    ids = np.random.default_rng(0).permutation(100_000)
    d = Descs.from_blocks(1 << 40, 4096, ids)
    assert len(d) == 100_000
    assert np.array_equal(d.addrs, (1 << 40) + ids.astype(np.uint64) * 4096)
    assert (d.lengths == 4096).all()


def test_descs_are_immutable():
    d = Descs.from_regions([1], [2])
    with pytest.raises(ValueError):
        d.array[0, 0] = 5


@pytest.mark.parametrize("bad", [np.zeros((3, 2)), np.zeros((2, 3), np.float32), [[-1, 2, 0]]])
def test_bad_descriptor_arrays_are_rejected(bad):
    with pytest.raises(InvalidArgument):
        Descs(np.asarray(bad))


def test_unknown_kind_is_rejected():
    with pytest.raises(InvalidArgument, match="memory kind"):
        Descs(np.zeros((1, 3), np.uint64), "HBM")


def test_locate_handles_overlap_nesting_and_devices():
    regions = Descs.from_regions([100, 1000, 150, 100], [100, 50, 200, 10], [0, 0, 0, 1])
    d = Descs.from_regions([100, 120, 340, 1000, 1049, 99, 345, 100, 105],
                           [10, 80, 10, 50, 2, 1, 5, 0, 10], [0, 0, 0, 0, 0, 0, 0, 0, 1])
    where = d.locate(regions)
    assert where.tolist()[:8] == [0, 0, 2, 1, -1, -1, 2, 0]
    assert where[8] == -1  # device 1 region [100, 110) does not hold [105, 115)
    for i, w in enumerate(where):  # every hit really contains its row
        if w >= 0:
            a, n, dev = d.array[i]
            ra, rn, rdev = regions.array[w]
            assert ra <= a and a + n <= ra + rn and dev == rdev


def _check_outcome(d: Descs, max_bytes: int):
    try:
        d.check_rows("request", max_rows=64, max_bytes=max_bytes)
    except InvalidDescriptor as e:
        return str(e)
    return None


def test_few_rows_are_checked_and_located_as_many_are(monkeypatch):
    """``check_rows`` and ``locate`` take a few rows on Python ints and
    more in numpy: both give the same answer on every row, edges included
    (wrapping ends, zero lengths, region bounds, unknown devices, the byte
    limit), and ``locate`` reuses the table's index once built."""
    import kvt.types as types

    top = 2**64
    regions = Descs.from_regions([100, 1000, 150, 100, top - 4096, 5000], [100, 50, 200, 10, 4095, 0],
                                 [0, 0, 0, 1, 0, 2])
    edges = [(100, 100, 0), (100, 101, 0), (99, 1, 0), (1000, 50, 0), (1049, 2, 0), (345, 5, 0), (349, 1, 0),
             (350, 1, 0), (100, 0, 0), (105, 10, 1), (100, 10, 1), (top - 4096, 4095, 0), (top - 4096, 4096, 0),
             (top - 1, 1, 0), (top - 1, 2**63, 0), (5000, 1, 2), (0, 1, 7), (top - 4096, 1, 0)]
    rng = np.random.default_rng(0)
    at_limit = [[(100, 250, 0), (150, 250, 0)], [(100, 250, 0), (150, 251, 0)], [(100, 501, 0)]]  # limit 500
    picks = at_limit + [edges[i:i + 4] for i in range(0, len(edges), 4)] + [[edges[j] for j in rng.integers(0, len(edges), k)]
                                                                  for k in rng.integers(1, 17, 200)]
    picks += [[(int(a), int(n), int(dv)) for a, n, dv in zip(rng.integers(0, 1200, k), rng.integers(0, 300, k),
                                                             rng.integers(0, 3, k))] for k in rng.integers(1, 17, 200)]
    for rows in picks:
        d = Descs(np.array(rows, np.uint64))
        assert len(d) <= types._FEW_ROWS
        few = d.locate(regions), _check_outcome(d, 500)
        with monkeypatch.context() as m:
            m.setattr(types, "_FEW_ROWS", 0)
            many = d.locate(regions), _check_outcome(d, 500)
        assert few[0].dtype == many[0].dtype == np.int64 and few[0].tolist() == many[0].tolist(), rows
        assert few[1] == many[1], rows
    assert regions._index is not None  # built on first use, kept for the table's life
    assert Descs.from_regions([100], [1]).locate(Descs.empty()).tolist() == [-1]


def test_check_within_names_the_first_bad_row():
    regions = Descs.from_regions([0], [100])
    with pytest.raises(InvalidDescriptor, match="row 1"):
        Descs.from_regions([0, 90], [10, 20]).check_within(regions)


def test_from_buffers_takes_kind_from_tensor_device():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8)
    d = Descs.from_buffers([t])
    assert d.kind is MemKind.DRAM and d.array.tolist() == [[t.data_ptr(), 128, 0]]
    assert Descs.from_buffers([t], kind="DEVICE").kind is MemKind.DEVICE
    with pytest.raises(InvalidArgument, match="contiguous"):
        Descs.from_buffers([t.t()])



def test_a_meta_tensor_is_refused():
    """A meta tensor has no storage (``data_ptr()`` 0); it registered as a
    DEVICE region at address 0."""
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgument, match="meta tensor"):
        Descs.from_buffers([torch.empty(4, 64, device="meta")])

def test_as_index_bounds():
    assert as_index(None, 3).tolist() == [0, 1, 2]
    with pytest.raises(InvalidArgument, match="out of range"):
        as_index([0, 3], 3)
    with pytest.raises(InvalidArgument):
        as_index([0.5], 3)


def test_xfer_state_err_carries_cause():
    cause = TransferError("boom")
    s = XferState.err(cause)
    assert s.failed and s.cause is cause and s.status is Status.ERR
    assert XferState.DONE.done and XferState.PROC.pending


@pytest.mark.parametrize("state", [XferState.PROC, XferState.DONE, XferState.err(TransferError("boom")),
                                   XferState(Status.DONE)])
def test_xfer_state_flags_name_exactly_its_status(state):
    flags = (state.pending, state.done, state.failed)
    assert flags == (state.status is Status.PROC, state.status is Status.DONE, state.status is Status.ERR)
    assert sum(flags) == 1
    copy = pickle.loads(pickle.dumps(state))  # a state crosses process boundaries (kvt bench, the connector)
    assert (copy.pending, copy.done, copy.failed) == flags and copy.status is state.status
    assert "done" not in repr(state)
    with pytest.raises(AttributeError):  # frozen: a flag cannot drift from the status
        state.done = not state.done


# -- numpy's errors on malformed input surface as InvalidArgument naming the argument --

@pytest.mark.parametrize("call, names", [
    (lambda: Descs.from_blocks([4096], 16, [-1]), "block_ids"),
    (lambda: Descs.from_blocks([-4096], 16, [0]), "base_addrs"),
    (lambda: Descs.from_blocks([4096], -16, [0]), "block_len"),
    (lambda: Descs.from_blocks([4096], 2**70, [0]), "block_len"),
    (lambda: Descs.from_blocks([4096], "16", [0]), "block_len"),
    (lambda: Descs.from_blocks([4096], 16, [0], stride=-1), "stride"),
    (lambda: Descs.from_blocks([4096], 16, [0], device=-1), "device"),
    (lambda: Descs.from_blocks([4096], 16, ["a"]), "block_ids"),
    (lambda: Descs.from_regions([-1], [1]), "addrs"),
    (lambda: Descs.from_regions([1], [2**64]), "lengths"),
    (lambda: Descs.from_regions(["a"], [1]), "addrs"),
    (lambda: Descs.from_regions([1], [1], devices=[-1]), "devices"),
    (lambda: Descs.from_regions([1, 2], [1, 2, 3]), "same length"),
    (lambda: Descs([[1, 2, 3], [1, 2]]), "shape \\(n, 3\\)"),
    (lambda: as_index([[1], [1, 2]], 5), "index"),
    (lambda: as_index([[1], [1, 2]], 5, "local_ids"), "local_ids"),
    (lambda: as_index([1], "5"), "must be an int"),
    # a cast straight to uint64 truncated floats and wrapped negative int64 arrays
    (lambda: Descs.from_regions([1.7], [1]), "addrs"),
    (lambda: Descs.from_regions(np.array([-4096]), [1]), "addrs"),
    (lambda: Descs.from_regions([1], np.array([-1], np.int32)), "lengths"),
    (lambda: Descs.from_regions([True], [1]), "addrs"),
    (lambda: Descs.from_regions([1.5, 2**63], [1, 1]), "addrs"),
    (lambda: Descs.from_blocks([4096], 16, np.array([-1])), "block_ids"),
    (lambda: Descs.from_blocks([4096], 16, [0.5]), "block_ids"),
    (lambda: Descs.from_buffers(5), "buffers must be a list"),
    (lambda: Descs.from_regions([1, 2], [3, 4])["x"], "cannot select descriptor rows"),
    (lambda: Descs.from_regions([1, 2], [3, 4])[1.5], "cannot select descriptor rows"),
    (lambda: Descs.from_regions([1, 2], [3, 4])[5], "cannot select descriptor rows"),
    (lambda: Descs.from_regions([1, 2], [3, 4])[:, 0], "whole descriptor rows"),
    (lambda: Descs.from_regions([1], [3]).locate(5), "regions must be Descs"),
    (lambda: Descs.from_regions([1], [3]).check_within([[1, 3, 0]]), "regions must be Descs"),
])
def test_malformed_inputs_raise_invalid_argument_naming_it(call, names):
    with pytest.raises(InvalidArgument, match=names):
        call()


def test_from_blocks_still_takes_numpy_scalars_and_2d_bases():
    d = Descs.from_blocks(np.array([[1000]], np.uint64), np.int64(16), np.array([[0, 1]]),
                          stride=np.uint64(32), device=np.int32(1))
    assert d.array.tolist() == [[1000, 16, 1], [1032, 16, 1]]
    top = Descs.from_blocks([0], 2**64 - 1, [0])  # the largest length still fits
    assert int(top.lengths[0]) == 2**64 - 1


def test_large_python_ints_still_make_exact_rows():
    """Python ints past int64, alone or mixed with small ones (numpy makes
    the mix float64), are taken exactly; rows still select as before."""
    d = Descs.from_regions([2**63 + 1, 1], [1, 2**64 - 2])
    assert d.array.tolist() == [[2**63 + 1, 1, 0], [1, 2**64 - 2, 0]]
    assert Descs.from_regions([], []).array.shape == (0, 3)
    assert Descs.from_regions(np.array([5], np.int32), 1).array.tolist() == [[5, 1, 0]]
    assert d[1].array.tolist() == [[1, 2**64 - 2, 0]] and len(d[np.array([True, False])]) == 1
