import subprocess
import sys

import numpy as np
import pytest

from kvt import Agent, memory
from kvt.errors import IncompatiblePeer, InvalidArgument, KvtTimeoutError, UnknownPeer
from kvt.types import Descs


def test_block_index_is_region_major():
    from kvt.wire import BlockLayout
    lay = BlockLayout(base_addrs=[0, 1000], block_len=10, num_blocks=5, stride=10)
    assert Agent.block_index(lay, [4, 0]).tolist() == [4, 0, 9, 5]
    with pytest.raises(InvalidArgument, match="out of range"):
        Agent.block_index(lay, [5])


def test_register_blocks_rejects_mixed_buffers():
    with Agent(name="a") as a:
        with pytest.raises(InvalidArgument, match="same shape"):
            a.register_blocks("kv", [np.zeros((4, 8), np.uint8), np.zeros((5, 8), np.uint8)])
        with pytest.raises(InvalidArgument, match="at least one"):
            a.register_blocks("kv", [])


def test_register_blocks_twice_replaces_layout():
    with Agent(name="a") as a, Agent(name="b") as b:
        first, second = np.zeros((4, 16), np.uint8), np.zeros((4, 16), np.uint8)
        a.register_blocks("kv", [first])
        a.register_blocks("kv", [second])
        assert a.layouts["kv"].base_addrs == [second.ctypes.data]
        second[:] = 3
        b.register_blocks("kv", [np.zeros((4, 16), np.uint8)])
        b.add_peer(a.info())
        a.add_peer(b.info())
        with a.write_blocks("b", [0], [1]) as x:
            x.wait(5)


def test_layout_mismatch_is_refused():
    with Agent(name="a") as a, Agent(name="b") as b:
        a.register_blocks("kv", [np.zeros((4, 16), np.uint8)])
        b.register_blocks("kv", [np.zeros((4, 32), np.uint8)])
        a.add_peer(b.info())
        with pytest.raises(IncompatiblePeer, match="does not match"):
            a.read_blocks("b", [0], [0])
        with pytest.raises(InvalidArgument, match="no block layout 'v'"):
            a.read_blocks("b", [0], [0], layout="v")


def test_register_torch_numpy_and_raw_rows():
    torch = pytest.importorskip("torch")
    with Agent(name="a") as a:
        t, n = torch.zeros(64), np.zeros(64, np.uint8)
        for mem in (t, n, [(n.ctypes.data, 64, 0)], Descs.from_buffers([n])):
            a.deregister(a.register(mem))


def test_wait_notif_times_out_and_filters():
    with Agent(name="a") as a, Agent(name="b") as b:
        b.add_peer(a.info())
        a.add_peer(b.info())
        with pytest.raises(KvtTimeoutError):
            a.wait_notif(timeout=0.2)
        b.notify("a", b"one")
        b.notify("a", b"two")
        assert a.wait_notif("b", timeout=5, match=b"two") == ("b", b"two")
        assert a.get_notifs() == {"b": [b"one"]}
        with pytest.raises(UnknownPeer):
            a.peer_info("zed")


def test_wait_notif_keeps_what_it_skips_in_a_bounded_queue(caplog):
    """A peer flooding an agent that waits for one message costs a bounded
    amount of memory: beyond the queue's bound the newest are dropped, with a
    warning; the awaited message is still returned."""
    from kvt.backend import Inbox

    with Agent(name="a") as a, Agent(name="b") as b:
        b.add_peer(a.info())
        a.add_peer(b.info())
        a._pending = Inbox(max_msgs=3)
        for i in range(5):
            b.notify("a", b"m%d" % i)
        b.notify("a", b"last")
        with caplog.at_level("WARNING", logger="kvt.agent"):
            assert a.wait_notif("b", timeout=5, match=b"last") == ("b", b"last")
        assert a.get_notifs() == {"b": [b"m0", b"m1", b"m2"]}
        assert "dropped" in caplog.text


def test_shared_memory_segments_are_found_by_address():
    buf = memory.empty((16, 4096))
    view = buf[3:5]
    segs = memory.segments_of(Descs.from_buffers([view.copy()]))
    assert len(segs) == 0  # a copy is private memory
    segs = memory.segments_of(Descs.from_regions([view.ctypes.data], [view.nbytes]))
    assert segs.shape == (1, 3) and int(segs[0, 0]) == buf.ctypes.data and int(segs[0, 1]) >= buf.nbytes
    assert not buf.any()


def test_kvt_demo_verifies_every_byte():
    out = subprocess.run([sys.executable, "-m", "kvt.cli", "demo", "--blocks", "32", "--request-blocks", "8",
                          "--layers", "2", "--iters", "2", "--timeout", "60"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "OK: every byte verified" in out.stdout and "GB/s" in out.stdout
    assert "blocks    16" in out.stdout  # 2 layers x 8 blocks
