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


@pytest.fixture
def linked():
    """Agent ``a`` connected to ``b``; a one-region layout "one" and a two-region "two" on both."""
    with Agent(name="a", backend="host") as a, Agent(name="b", backend="host") as b:
        keep = []
        for x in (a, b):
            bufs = [memory.empty((8, 256)) for _ in range(2)]
            keep.append(bufs)
            x.register_blocks("one", bufs[:1])
            x.register_blocks("two", bufs)
        yield a, a.connect(b.listen())


@pytest.mark.parametrize("call", [
    lambda a, p: a.read_blocks(p, np.int64(1), np.int64(2), "one"),  # len() of a scalar: TypeError
    lambda a, p: a.read_blocks(p, 1, 2, "one"),
    lambda a, p: a.read_blocks(p, (i for i in [1]), [2], "one"),
    lambda a, p: a.read_blocks(["x"], [1], [2], "one"),  # unhashable peer: TypeError
    lambda a, p: a.read_blocks(p, [1], [2], ["one"]),
    lambda a, p: a.remove_peer(["x"]),
    lambda a, p: a.peer_info(["x"]),
    lambda a, p: a.notify(["x"], b"hi"),
    lambda a, p: a.reconnect(p, "1"),  # a bad argument, not "the peer seems gone"
    lambda a, p: a.connect(None),
    lambda a, p: a.connect(b"tcp://127.0.0.1:1"),
    lambda a, p: a.register_blocks("z", [np.zeros((0, 16), np.uint8)]),  # zero blocks: ValueError after registering
    lambda a, p: a.register_blocks("z", [np.zeros((4, 0), np.uint8)]),
    lambda a, p: a.register_blocks("z", [__import__("torch").zeros((4, 0))]),
    lambda a, p: a.register_blocks("z", [np.array(5, np.uint8)]),  # 0-d: IndexError
    lambda a, p: a.register_blocks("z", None),  # TypeError
    lambda a, p: a.register_blocks("z", 5),
    lambda a, p: a.register_blocks(5, [np.zeros((4, 16), np.uint8)]),  # every peer's connect failed after
    lambda a, p: a.register_blocks("\udcff", [np.zeros((4, 16), np.uint8)]),  # the server answered nothing after
], ids=["scalar-ids", "int-ids", "generator-ids", "list-peer", "list-layout", "remove-list", "info-list",
        "notify-list", "reconnect-text-timeout", "connect-none", "connect-bytes", "zero-blocks", "zero-bytes",
        "zero-bytes-tensor",
        "0-d", "none-buffers", "int-buffers", "int-layout", "surrogate-layout"])
def test_wrong_arguments_raise_kvt_errors_and_leave_the_agent_working(linked, call):
    from kvt.errors import KvtError, PeerDisconnected

    a, peer = linked
    with pytest.raises(KvtError) as e:
        call(a, peer)
    assert not isinstance(e.value, PeerDisconnected), e.value  # the caller's mistake, named as such
    with a.read_blocks(peer, [1], [2], "one") as t:  # and the agent carries on
        t.wait(10)


@pytest.mark.parametrize("name", [5, "n" * 257, "\ud800"])
def test_an_agent_name_that_cannot_travel_is_refused(name):
    """A lone-surrogate name failed at the first connect (UnicodeEncodeError);
    a non-str one got the peer's refusal of the wrong message type."""
    with pytest.raises(InvalidArgument, match="agent name"):
        Agent(name=name, backend="host")
