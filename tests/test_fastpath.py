"""The post path in C (kvt/_fastpath.c): ``Agent.transfer_blocks``' common
case stays in C and every other case reaches the Python path, which has the
checks and the errors' wording; ``Transfer`` behaves the same on both.  The
rest of the suite runs on both paths too (CI runs it with ``KVT_NATIVE=0``)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import kvt.agent as agent_mod
from kvt import Agent, Transfer
from kvt.errors import ClosedError, InvalidArgument, InvalidHandle
from kvt.types import Op

native = pytest.mark.skipif(agent_mod.POST_PATH != "native", reason="the C post path is not in use")


def test_native_post_path_is_in_use_unless_disabled():
    """A build that silently lost the extension would pass every other test on the twin."""
    if os.environ.get("KVT_NATIVE", "1") == "0":
        assert agent_mod.POST_PATH == "python" and "KVT_NATIVE=0" in agent_mod.POST_PATH_REASON
    else:
        assert agent_mod.POST_PATH == "native", agent_mod.POST_PATH_REASON


@pytest.fixture
def pair():
    with Agent(name="a") as a, Agent(name="b") as b:
        for x in (a, b):
            x.register_blocks("kv", [np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)])
            x.register_blocks("two", [np.zeros((4, 64), np.uint8), np.zeros((4, 64), np.uint8)])
        yield a, a.connect(b.listen())


@pytest.fixture
def slow_calls(monkeypatch):
    """Every call that reached ``Agent._transfer_blocks`` (the Python path)."""
    calls, real = [], Agent._transfer_blocks

    def counted(self, *args, **kw):
        calls.append((args, kw))
        return real(self, *args, **kw)

    monkeypatch.setattr(Agent, "_transfer_blocks", counted)
    return calls


@native
def test_the_common_case_stays_in_c(pair, slow_calls):
    """A prepped route of one region, positional arguments, no flag up: no
    Python frame (the point of the C path; a fast path that always fell
    back would pass every behavioural test)."""
    a, peer = pair
    with a.read_blocks(peer, [0], [1]) as t:  # the first post preps the route (Python)
        t.wait(10)
    del slow_calls[:]
    for ids in ([1], np.array([2, 3]), np.array([0], np.int32), None):
        with a.transfer_blocks(Op.READ, peer, ids, ids) as t:
            t.wait(10)
        with a.transfer_blocks(Op.WRITE, peer, ids, ids, "kv", None, "kv") as t:
            t.wait(10)
    assert slow_calls == []


@native
@pytest.mark.parametrize("case", ["keywords", "several regions", "unprepped route", "orphans", "lost peer",
                                  "integrity", "scalar ids", "unhashable peer", "closed"])
def test_every_other_case_takes_the_python_path(pair, slow_calls, case):
    a, peer = pair
    for layout in ("kv", "two"):  # both routes prepped
        with a.read_blocks(peer, [0], [1], layout=layout) as t:
            t.wait(10)
    del slow_calls[:]
    args, kw, raises = [Op.READ, peer, [0], [1]], {}, None
    if case == "keywords":
        kw = {"layout": "kv"}
    elif case == "several regions":
        args.append("two")
    elif case == "unprepped route":
        a._routes.clear()
    elif case == "orphans":
        t = a.read_blocks(peer, [0], [1])
        t.wait(10)
        del t  # dropped unreleased: its finalizer hands it to the agent
        gc.collect()
        assert a._orphans
        del slow_calls[:]
    elif case == "lost peer":
        a._lost["someone else"] = float("inf")
    elif case == "integrity":
        a._integrity = True  # (the Python path reads the setting itself: off here, so the post goes on)
    elif case == "scalar ids":
        args[2:] = [0, 1]
        raises = InvalidArgument
    elif case == "unhashable peer":
        args[1] = [peer]
        raises = InvalidArgument
    elif case == "closed":
        a.close()
        raises = ClosedError
    if raises is None:
        with a.transfer_blocks(*args, **kw) as t:
            t.wait(10)
    else:
        with pytest.raises(raises):
            a.transfer_blocks(*args, **kw)
    assert len(slow_calls) == 1


def test_transfer_fields_state_release_and_telemetry(pair):
    a, peer = pair
    t = a.read_blocks(peer, [0, 1], [2, 3])
    assert isinstance(t, Transfer) and t.peer == peer and t.nbytes == 128 and t.descs == 2
    t.wait(10)
    assert t.state().done and t._t2 is not None
    tel = t.telemetry
    assert tel.nbytes == 128 and tel.descs == 2 and tel.post_s >= 0 and tel.xfer_s >= 0
    t.release()
    t.release()  # idempotent
    with pytest.raises(InvalidHandle, match="was released"):
        t.state()
    assert t.telemetry == tel  # telemetry stays


def test_a_transfer_built_by_hand(pair):
    """The connector builds Transfers around handles it posted itself."""
    a, peer = pair
    h = a.backend.transfer(Op.READ, a._prep(None, "kv"), np.array([0]), a._prep(peer, "kv"), np.array([1]))
    t = Transfer(a, h, 64)
    assert (t.descs, t.peer, t.verify, t._t2) == (0, None, None, None) and t._t0 == t._t1
    t.wait(10)
    t.release()
    with pytest.raises(TypeError):
        Transfer(a)


def test_a_dropped_transfer_is_handed_to_its_agent(pair):
    """Dropped unreleased, a transfer's handle goes to its agent's orphans
    (released on the next post); released or after close, it does not."""
    a, peer = pair
    t = a.read_blocks(peer, [0], [1])
    t.wait(10)
    h = t.handle
    del t
    gc.collect()
    assert a._orphans == [h]
    a.read_blocks(peer, [0], [1]).release()  # the next post releases it
    assert a._orphans == []
    t = a.read_blocks(peer, [0], [1])
    t.wait(10)
    t.release()
    del t
    gc.collect()
    assert a._orphans == []


def _python_block_index(layout, ids):
    """``Agent.block_index`` as its Python path computes it."""
    regions = agent_mod._region_offsets(layout)
    arr = agent_mod.as_index(ids, layout.num_blocks, "block ids")
    return arr if regions is None else (regions + arr).ravel()


@pytest.mark.parametrize("regions", [1, 3])
@pytest.mark.parametrize("ids", [[], [0], [4, 0, 2], (3, 1), list(range(5))[::-1]])
def test_block_index_matches_the_python_path(regions, ids):
    from kvt.wire import BlockLayout
    lay = BlockLayout(base_addrs=[1000 * r for r in range(regions)], block_len=10, num_blocks=5, stride=10)
    got = Agent.block_index(lay, ids)
    assert got.dtype == np.int64 and got.tolist() == _python_block_index(lay, ids).tolist()
    if agent_mod.POST_PATH == "native":  # the C call took it (a C path that always declined would pass the above)
        assert agent_mod._fastpath.block_index(ids, 5, regions).tolist() == got.tolist()


@native
@pytest.mark.parametrize("ids", [[5], [-1], [1 << 70], [0, True], [np.int64(1)], [1.0], np.array([1]), iter([1])],
                         ids=["past", "negative", "huge", "bool", "numpy-int", "float", "ndarray", "iterator"])
def test_block_index_declines_all_but_in_range_ints(ids):
    """Anything but a list or tuple of ints in range goes to the Python path,
    which converts it or raises with the usual wording."""
    assert agent_mod._fastpath.block_index(ids, 5, 2) is None
    assert agent_mod._fastpath.block_index([0], 1 << 62, 4) is None  # regions x blocks overflows
