"""The host backend across two real processes, over each of its paths."""

import gc
import time

import numpy as np
import pytest
import zmq

from kvt import Agent, Descs, Op, Transfer
from kvt.types import SETTLED
from kvt.errors import (ClosedError, InvalidArgument, InvalidDescriptor, InvalidHandle, KvtError,
                        PeerDisconnected, TransferError, UnknownPeer)
from kvt.wire import decode, encode
from kvt_host.protocol import Reply, Request

from peer import BLOCK, NUM_BLOCKS, pattern, peer_process

# (peer memory in shared segments?, our transport option) -> path taken
PATHS = {"shm": (True, "auto"), "cma": (False, "auto"), "tcp": (True, "tcp")}


@pytest.fixture(params=sorted(PATHS))
def pair(request):
    shared, transport = PATHS[request.param]
    with peer_process(shared=shared) as peer:
        with Agent(name="me", backend="host", options={"transport": transport, "timeout": 5}) as me:
            local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
            me.register_blocks("kv", [local])
            name = me.connect(peer.endpoint, timeout=10)
            yield me, name, local, peer


def test_read_scatter_gather_blocks(pair):
    me, name, local, _ = pair
    remote_ids, local_ids = [5, 0, 63, 7, 8, 9], [1, 2, 3, 40, 41, 42]
    with me.read_blocks(name, local_ids, remote_ids) as x:
        x.wait(10)
    assert np.array_equal(local[local_ids], pattern()[remote_ids])
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), local_ids)
    assert not local[untouched].any()


def test_write_with_notif_arrives_after_data(pair):
    me, name, local, peer = pair
    local[:] = pattern(salt=99)
    with me.write_blocks(name, [3, 4, 5], [10, 20, 30], notif=b"req-1 done") as x:
        x.wait(10)
    sender, msg, seen = peer.await_notif()
    assert (sender, msg) == ("me", b"req-1 done")
    want = pattern()
    want[[10, 20, 30]] = pattern(salt=99)[[3, 4, 5]]
    assert np.array_equal(seen, want)  # data was in place when the notification was seen


def test_notifications_arrive_in_order(pair):
    me, name, _, peer = pair
    for i in range(50):
        me.notify(name, b"n%d" % i)
    deadline = time.monotonic() + 10
    got = []
    while len(got) < 50 and time.monotonic() < deadline:
        got += peer.notifs().get("me", [])
    assert got == [b"n%d" % i for i in range(50)]


def test_peer_asking_for_unregistered_memory_is_refused_and_peer_keeps_serving(pair):
    me, name, local, peer = pair
    endpoint = me.backend._peers[name].md.endpoint
    layout = me.peer_info(name).layouts["kv"]
    beyond = layout.base_addrs[0] + NUM_BLOCKS * BLOCK  # just past what it registered
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for op, extra in (("READ", []), ("WRITE", [b"\xff" * 4096])):
            rows = np.array([[beyond, 4096, 0]], np.uint64).tobytes()
            sock.send_multipart([encode(Request(id=7, sender="mallory", op=op, rows=rows))] + extra)
            assert sock.poll(10_000)
            frames = sock.recv_multipart()
            reply = decode(frames[0], Reply)
            assert reply.code == "out_of_region" and len(frames) == 1  # nothing read
    finally:
        sock.close()
    assert np.array_equal(peer.contents(), pattern())  # nothing written
    with me.read_blocks(name, [0], [1]) as x:  # and it still serves
        x.wait(10)
    assert np.array_equal(local[0], pattern()[1])


def test_staged_device_memory_on_both_sides():
    """Memory registered as another torch device kind goes through host
    mirrors with torch copies (CPU tensors stand in for the device here)."""
    torch = pytest.importorskip("torch")
    with peer_process(kind="DEVICE") as peer, Agent(name="me", options={"timeout": 5}) as me:
        local = torch.zeros((NUM_BLOCKS, BLOCK), dtype=torch.uint8)
        me.register_blocks("kv", [local], kind="DEVICE")
        name = me.connect(peer.endpoint, timeout=10)
        with me.read_blocks(name, [0, 1, 9], [9, 8, 7]) as x:
            x.wait(10)
        assert np.array_equal(local.numpy()[[0, 1, 9]], pattern()[[9, 8, 7]])
        local[5] = 42
        with me.write_blocks(name, [5], [63]) as x:
            x.wait(10)
        assert (peer.contents()[63] == 42).all()


def test_dead_peer_turns_transfers_to_err_and_agent_serves_others():
    with peer_process("p1") as p1, peer_process("p2") as p2, Agent(name="me", options={"timeout": 3}) as me:
        local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [local])
        n1, n2 = me.connect(p1.endpoint, timeout=10), me.connect(p2.endpoint, timeout=10)
        p1.kill()
        for op in (me.read_blocks, me.write_blocks):
            t = time.monotonic()
            x = op(n1, [0], [0])
            with pytest.raises(PeerDisconnected):
                x.wait(10)
            assert time.monotonic() - t < 10
            x.release()
        with me.read_blocks(n2, [0], [2]) as x:
            x.wait(10)
        assert np.array_equal(local[0], pattern()[2])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_dead_peer_over_tcp_or_shm_never_hangs(transport):
    with peer_process("p1") as p1, Agent(name="me", options={"timeout": 2, "transport": transport}) as me:
        me.register_blocks("kv", [np.zeros((NUM_BLOCKS, BLOCK), np.uint8)])
        n1 = me.connect(p1.endpoint, timeout=10)
        p1.kill()
        x = me.read_blocks(n1, list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)))
        with pytest.raises(TransferError):
            x.wait(8)


def test_small_same_host_request_is_settled_when_transfer_returns(monkeypatch):
    """The one-call path (shared segments, host memory): done before
    ``transfer`` returns, which says so with ``SETTLED``, so the agent never
    asks the backend about it again (no polling, nothing to release, not
    an orphan when dropped); a request over ``inline_bytes`` takes the
    worker, gets a handle, and lands the same bytes."""
    with peer_process(shared=True) as peer, \
            Agent(name="me", options={"timeout": 5, "inline_bytes": 2 * BLOCK}) as me:
        local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [local])
        name = me.connect(peer.endpoint, timeout=10)
        asked, be = [], me.backend
        for verb in ("check_state", "release", "wait"):
            monkeypatch.setattr(be, verb, lambda h, *a, _real=getattr(be, verb), _verb=verb:
                                (asked.append(_verb), _real(h, *a))[1])
        x = me.read_blocks(name, [1, 2], [5, 0])
        assert x.handle == SETTLED
        assert np.array_equal(local[[1, 2]], pattern()[[5, 0]])
        assert x.state().done and x.telemetry.xfer_s is not None
        x.wait(0)
        x.release()
        me.read_blocks(name, [1], [5])  # dropped unreleased
        gc.collect()
        by_hand = Transfer(me, SETTLED, BLOCK)  # as the connector wraps what it posts itself
        assert by_hand.state().done and by_hand.telemetry.xfer_s is not None
        by_hand.release()
        assert asked == [] and me._orphans == []
        with me.read_blocks(name, [3, 4, 6], [7, 8, 9]) as big:  # 3 blocks > inline_bytes
            assert big.handle != SETTLED
            big.wait(10)
        assert np.array_equal(local[[3, 4, 6]], pattern()[[7, 8, 9]])
        assert "check_state" in asked and "release" in asked
        local[10] = 77
        w = me.write_blocks(name, [10], [11])
        assert w.handle == SETTLED and w.state().done
        w.release()
        assert (peer.contents()[11] == 77).all()
        assert be.check_state(SETTLED).done  # the protocol's answers, however often
        be.release(SETTLED)
        be.release(SETTLED)


def test_a_notification_after_an_inline_copy_is_sent_by_the_posting_thread(monkeypatch):
    """Once the owner admitted our socket, a same-host copy's notification is
    queued to ZMQ by the thread that posted it (no hand-off to the lane's
    worker), and every notification still arrives once, in order."""
    with peer_process(shared=True) as peer, Agent(name="me", options={"timeout": 5}) as me:
        local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [local])
        name = me.connect(peer.endpoint, timeout=10)
        # the first goes through the worker, which waits for the owner to admit the socket (kvt_host.notifs)
        me.notify(name, b"hello")
        link, deadline = me.backend._peers[name].link, time.monotonic() + 10
        while not link.admitted and time.monotonic() < deadline:
            time.sleep(0.001)
        handed, real = [], me.backend._send_notif
        monkeypatch.setattr(me.backend, "_send_notif", lambda p, m: (handed.append(m), real(p, m))[1])
        for i in range(20):
            with me.read_blocks(name, [i], [i], notif=b"r%d" % i) as x:
                x.wait(10)
        got, deadline = [], time.monotonic() + 10
        while len(got) < 21 and time.monotonic() < deadline:
            got += peer.notifs().get("me", [])
        assert got == [b"hello"] + [b"r%d" % i for i in range(20)]
        assert handed == []
        assert np.array_equal(local[:20], pattern()[:20])


@pytest.mark.parametrize("inline_bytes", [1 << 24, 1], ids=["inline", "worker"])
@pytest.mark.parametrize("op", ["read_blocks", "write_blocks"])
def test_shm_request_after_the_owner_deregistered_is_refused_and_moves_nothing(op, inline_bytes):
    """The owner's registration epoch moved after we mapped its segments and
    prepped: the one-call path (on our thread, or queued for the worker when
    over ``inline_bytes``) must not copy; the owner's server refuses."""
    from kvt.errors import RemoteRejected
    with peer_process(shared=True) as peer, \
            Agent(name="me", options={"timeout": 5, "inline_bytes": inline_bytes}) as me:
        local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8) if op == "read_blocks" else pattern(salt=7)
        me.register_blocks("kv", [local])
        name = me.connect(peer.endpoint, timeout=10)
        with me.read_blocks(name, [0], [1]) as x:  # routes prepped, segments mapped
            x.wait(10)
        local[0] = 0 if op == "read_blocks" else local[0]
        before_local, before_far = local.copy(), peer.contents().copy()
        peer.deregister()
        x = getattr(me, op)(name, [2, 3], [4, 5])
        with pytest.raises(RemoteRejected):
            x.wait(10)
        x.release()
        assert np.array_equal(local, before_local) and np.array_equal(peer.contents(), before_far)


# -- bad input, checked before any byte moves (one process, two agents) -----

@pytest.fixture
def two():
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        abuf, bbuf = np.zeros((8, 256), np.uint8), np.arange(8 * 256, dtype=np.uint8).reshape(8, 256)
        a.register_blocks("kv", [abuf])
        b.register_blocks("kv", [bbuf])
        a.add_peer(b.info())
        yield a, b, abuf, bbuf


def test_remote_descriptors_outside_registered_memory(two):
    a, b, abuf, bbuf = two
    with pytest.raises(InvalidDescriptor, match="peer 'b'"):
        a.backend.prep("b", Descs.from_regions([bbuf.ctypes.data + bbuf.nbytes - 10], [20]))
    assert not abuf.any()


def test_local_descriptors_outside_registered_memory(two):
    a, *_ = two
    other = np.zeros(64, np.uint8)
    with pytest.raises(InvalidDescriptor, match="local descriptors"):
        a.backend.prep(None, Descs.from_buffers([other]))


def test_unknown_peer(two):
    a, *_ = two
    with pytest.raises(UnknownPeer, match="nobody"):
        a.backend.prep("nobody", Descs.from_regions([0], [0]))
    with pytest.raises(UnknownPeer):
        a.notify("nobody", b"x")
    with pytest.raises(UnknownPeer):
        a.backend.remove_remote("nobody")
    with pytest.raises(LookupError):  # also the builtin
        a.read_blocks("nobody", [0], [0])


def test_released_handles(two):
    a, *_ = two
    x = a.read_blocks("b", [0], [1])
    x.wait(5)
    a.backend.release(x.handle)
    with pytest.raises(InvalidHandle):
        a.backend.check_state(x.handle)
    with pytest.raises(InvalidHandle):
        a.backend.release(x.handle)
    with pytest.raises(InvalidHandle):
        a.backend.transfer(Op.READ, 12345, None, 12346, None)


def test_mismatched_pairs_and_bad_indices(two):
    a, b, abuf, _ = two
    be = a.backend
    lp = be.prep(None, Descs.from_blocks(abuf.ctypes.data, 256, range(8)))
    rp = be.prep("b", Descs.from_blocks(b.layouts["kv"].base_addrs[0], 128, range(8)))
    with pytest.raises(InvalidArgument, match="differ in length"):
        be.transfer(Op.READ, lp, [0], rp, [0])
    with pytest.raises(InvalidArgument, match="paired"):
        be.transfer(Op.READ, lp, [0, 1], lp, [0])
    with pytest.raises(InvalidArgument, match="out of range"):
        a.read_blocks("b", [8], [0])
    with pytest.raises(InvalidArgument, match="op must be"):
        be.transfer("COPY", lp, [0], lp, [1])
    with pytest.raises(InvalidArgument, match="local_prep"):
        be.transfer(Op.READ, rp, [0], lp, [0])
    assert not abuf.any()


def test_local_transfer_and_self_notification(two):
    a, _, abuf, _ = two
    be = a.backend
    abuf[0] = 5
    lp = be.prep(None, Descs.from_blocks(abuf.ctypes.data, 256, range(8)))
    h = be.transfer(Op.WRITE, lp, [0], lp, [3], notif=b"self")
    deadline = time.monotonic() + 5
    while be.check_state(h).pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert be.check_state(h).done and (abuf[3] == 5).all()
    assert be.get_notifs() == {"a": [b"self"]}


def test_oversized_notification_is_rejected(two):
    a, *_ = two
    with pytest.raises(InvalidArgument, match="exceeds"):
        a.notify("b", b"x" * (a.backend.capabilities.max_notif_bytes + 1))


def test_close_is_idempotent_and_final():
    a = Agent(name="a")
    a.close()
    a.close()
    with pytest.raises(ClosedError):
        a.register(np.zeros(4, np.uint8))
    with pytest.raises(ClosedError):
        a.backend.get_notifs()


def test_only_kvt_errors_escape_for_garbage_metadata(two):
    a, *_ = two
    for junk in (b"", b"\x00" * 10, encode(Request(id=1, sender="x", op="READ"))):
        with pytest.raises(KvtError):
            a.backend.add_remote(junk)


def test_close_at_interpreter_exit():
    """vLLM's finalizers close the connector at interpreter exit, when thread
    pools refuse new work: close still closes every peer, quietly."""
    import subprocess
    import sys
    script = ("import atexit\nfrom kvt import Agent\n"
              "a, b = Agent(backend='host', name='a'), Agent(backend='host', name='b')\n"
              "a.connect(b.listen('127.0.0.1', 0))\n"
              "atexit.register(b.close)\natexit.register(a.close)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


_FIXED = 0x2F0000000000  # an address far from where Linux places a small process's mappings
_FIXED_LEN = NUM_BLOCKS * BLOCK


def _fixed_buffer(fill: int) -> np.ndarray:
    """Anonymous memory at ``_FIXED`` (never over an existing mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    map_fixed_noreplace = 0x100000
    got = libc.mmap(_FIXED, _FIXED_LEN, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed_noreplace, -1, 0)
    if got != _FIXED:
        raise OSError(ctypes.get_errno(), f"cannot map {_FIXED:#x}")
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * _FIXED_LEN).from_address(_FIXED)).reshape(NUM_BLOCKS, BLOCK)
    buf[:] = fill
    return buf


def _incarnation(register_fixed: bool, q, cmd) -> None:
    """A host backend named "restarting" with memory at ``_FIXED``: registered
    (the first process), or mapped but never registered (its restart, which
    registers other memory).  Answers "contents" with that memory's bytes."""
    from kvt_host.backend import HostBackend

    fixed = _fixed_buffer(0x5A)
    backend = HostBackend("restarting", {"timeout": 5})
    backend.register(Descs.from_regions([_FIXED], [_FIXED_LEN]) if register_fixed else np.ones(_FIXED_LEN, np.uint8))
    q.put(backend.local_metadata())
    while cmd.get(timeout=120) == "contents":
        q.put(fixed.tobytes())


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_a_prep_from_before_the_peer_restarted_moves_nothing_the_new_process_did_not_register(op):
    """Rows prepped against a peer's first process are judged against what its
    restart registered (by its server) before any byte moves: the same-host
    shortcut (cma) must not touch the new process's memory at those addresses."""
    from peer import spawned

    with Agent(name="me", backend="host", options={"timeout": 5}) as me:
        backend = me.backend
        local = np.full((NUM_BLOCKS, BLOCK), 0x11, np.uint8)
        backend.register(local)
        lp = backend.prep(None, Descs.from_regions(local.ctypes.data + np.arange(NUM_BLOCKS) * BLOCK,
                                                   [BLOCK] * NUM_BLOCKS))
        with spawned(_incarnation, True) as (_, _, _, first):
            name = backend.add_remote(first)
            rp = backend.prep(name, Descs.from_regions(_FIXED + np.arange(NUM_BLOCKS) * BLOCK, [BLOCK] * NUM_BLOCKS))
            h = backend.transfer(op, lp, None, rp, None)
            assert backend.wait(h, 10).done  # the first process registered that memory
            backend.release(h)
        local[:] = 0x11
        with spawned(_incarnation, False) as (_, q, cmd, second):
            assert backend.add_remote(second) == name
            state = backend.wait(backend.transfer(op, lp, None, rp, None), 10)
            cmd.put("contents")
            theirs = np.frombuffer(q.get(timeout=30), np.uint8)
        assert state.failed and isinstance(state.cause, TransferError), state
        assert (local == 0x11).all() and (theirs == 0x5A).all(), "bytes moved to or from unregistered memory"


@pytest.mark.parametrize("value", ["lots", -1, 1.5, True, None, 1 << 50])
def test_a_bad_inline_bytes_is_a_config_error_naming_it(value):
    # before: "failed to start: ValueError: invalid literal for int()" (or accepted: -1, 1.5, True)
    from kvt import ConfigError
    from kvt_host.backend import HostBackend

    with pytest.raises(ConfigError, match="inline_bytes"):
        HostBackend("bad-inline", {"timeout": 5, "inline_bytes": value})


# -- a small request is sliced on Python ints, a large one with numpy: both the same --

def _slicings(rows: np.ndarray, max_rows: int, max_bytes: int) -> tuple[list, list]:
    from kvt_host.protocol import chunks
    from kvt_host.stream import _runs
    return ([part.tolist() for part in chunks(rows, max_rows, max_bytes)],
            [(direct, run.tolist(), n) for direct, run, n in _runs(rows[:, [0, 2]])])


def test_few_rows_are_sliced_as_many_are(monkeypatch):
    import random

    import kvt_host.protocol as protocol
    import kvt_host.stream as stream
    rng = random.Random(13)
    edges = [0, 1, 4096, stream._DIRECT - 1, stream._DIRECT, stream._PIECE, stream._PIECE + 7, 3 << 20,
             protocol.MAX_REQUEST_BYTES // 2, protocol.MAX_REQUEST_BYTES // 2 + 1]
    for _ in range(400):
        k = rng.randint(0, protocol.FEW_ROWS)
        rows = np.zeros((k, 4), np.uint64)
        rows[:, 0], rows[:, 1] = np.arange(k) * 8, np.arange(k) * 16
        top = rng.choice([stream._DIRECT, 20 << 20])  # short rows only: runs cut at piece boundaries
        rows[:, 2] = [rng.choice(edges) if rng.random() < 0.5 else rng.randrange(top) for _ in range(k)]
        limits = rng.choice([protocol.MAX_REQUEST_ROWS, 1, 3]), rng.choice([protocol.MAX_REQUEST_BYTES, 1 << 20, 3 << 20])
        few = _slicings(rows, *limits)
        with monkeypatch.context() as m:  # the vectorised path for the same rows
            m.setattr(protocol, "FEW_ROWS", -1)
            m.setattr(stream, "FEW_ROWS", -1)
            assert _slicings(rows, *limits) == few, (rows[:, 2].tolist(), limits)


# -- a peer's lane: its worker's jobs and callers' inline requests never overlap ------------

def test_a_lane_runs_a_callers_request_and_its_jobs_one_at_a_time_in_order():
    """The one-call path's claim (``_Lane.enter``): taken only when no job is
    queued or running and no other caller holds it; a job queued meanwhile
    waits for the caller's ``leave``; a teardown job's ``wait_caller`` does
    not wait for itself; a caller holding past the limit is reported."""
    import threading

    from kvt_host.backend import _Lane

    lane = _Lane("test-lane", limit=0.5)
    try:
        order: list[str] = []
        assert lane.enter()
        other = threading.Thread(target=lambda: order.append(lane.enter()))
        other.start()
        other.join(5)
        assert not lane.enter()
        job = lane.submit(lambda: order.append("job"))
        time.sleep(0.2)  # the worker is free to run it: it must wait for the caller
        order.append("caller left")
        lane.leave()
        job.result(5)
        assert order == [False, "caller left", "job"]
        gate = threading.Event()
        running = lane.submit(gate.wait, 5)
        assert not lane.enter()  # a job runs
        queued = lane.submit(lambda: lane.wait_caller())
        gate.set()
        running.result(5)
        assert queued.result(5) is True  # on the worker: no caller can hold it, no wait
        with lane._lock:
            lane._busy += 1  # a job queued, its worker not yet at it: a caller must not run ahead
        assert not lane.enter()
        lane._done()
        assert lane.enter()  # idle again
        t0 = time.monotonic()
        assert not lane.wait_caller() and time.monotonic() - t0 >= 0.45  # held past the limit
        lane.leave()
        assert lane.wait_caller()
    finally:
        lane.pool.shutdown(wait=True)


def _fds() -> tuple[int, int]:
    """(open fds, of them kvt registration epochs)."""
    import os
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own fd, gone)
            pass
    return len(links), sum(link.startswith("/memfd:kvt-epoch") for link in links)


def test_a_backend_that_cannot_listen_leaves_nothing_behind():
    """Each failed construction used to leave its registration epoch page (a
    memfd) and its lane behind: an engine retrying its config leaked an fd a try."""
    from kvt.errors import ConfigError
    from kvt_host.backend import HostBackend
    HostBackend("warm", {}).close()  # (first-use fds: loggers, zmq's context)
    before = _fds()
    for _ in range(20):
        with pytest.raises(ConfigError, match="listen_host"):
            HostBackend("x", {"listen_host": "192.0.2.1"})  # TEST-NET-1: not ours to bind
    after = _fds()  # (other tests' objects may be collected meanwhile: fewer fds is fine)
    assert after[1] == before[1] and after[0] <= before[0], (before, after)


@pytest.mark.parametrize("option", ["listen_host", "advertise_host"])
@pytest.mark.parametrize("value", ["", "\ud800", 5, None])
def test_a_host_that_is_no_host_name_is_a_config_error(option, value):
    """advertise_host went unchecked into the metadata (a lone surrogate broke
    every metadata request, a number was published as ``tcp://5:port``)."""
    from kvt.errors import ConfigError
    from kvt_host.backend import HostBackend
    with pytest.raises(ConfigError, match=option):
        HostBackend("x", {option: value})


def test_replacing_a_layout_ends_our_transfers_of_the_old_memory_first():
    """``register_blocks`` replacing a layout deregisters the old memory; the
    caller frees it next.  It returned while this agent's own queued READs
    still copied into it (freed, a SIGSEGV).  Now they end ERR first, the old
    memory sees no byte after the call returns, and registering the same
    buffers again leaves transfers of them alone."""
    with Agent(name="a", options={"timeout": 10, "inline_bytes": 0}) as a, \
            Agent(name="b", options={"timeout": 10}) as b:
        old, far = np.zeros((64, 1 << 20), np.uint8), np.full((64, 1 << 20), 7, np.uint8)
        a.register_blocks("kv", [old])
        b.register_blocks("kv", [far])
        p = a.add_peer(b.info())
        ids = list(range(64))
        xs = [a.read_blocks(p, ids, ids) for _ in range(4)]
        new = np.zeros((64, 1 << 20), np.uint8)
        a.register_blocks("kv", [new])
        old.fill(0xFF)
        for x in xs:
            try:
                x.wait(10)
            except TransferError as e:
                assert "deregistered" in str(e)
        assert (old == 0xFF).all(), "a READ landed in the replaced layout's memory after register_blocks returned"
        xs = [a.read_blocks(p, ids, ids) for _ in range(4)]
        a.register_blocks("kv", [new])  # the same memory again: its transfers run on
        for x in xs:
            x.wait(10)
        assert (new == 7).all()
