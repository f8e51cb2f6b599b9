"""A malicious peer speaking the host backend's data stream (kvt_host.stream)
directly to an owner in another process: tokens, malformed and refused
requests, lies about lengths, stalls.  The owner must stay alive, touch only
registered memory, keep serving others, and keep an honest stream in step."""

from __future__ import annotations

import secrets
import socket
import struct
import time

import numpy as np
import pytest
from owner import REGION
from test_host_server import ask, assert_unharmed, owner, req, rows, sock  # noqa: F401 - fixtures

HEAD = struct.Struct("<4sBBHI")
READ, WRITE = 1, 2
PATTERN = (np.arange(REGION) * 7 % 251).astype(np.uint8)


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _token(owner, sock) -> tuple[str, int, bytes]:
    rep, _ = ask(sock, req("STREAM"))
    assert not rep.error and rep.port and len(rep.token) == 16
    return owner.data.split("//")[1].rsplit(":", 1)[0], rep.port, rep.token


def _stream(owner, sock, token: bytes | None = None) -> socket.socket:
    host, port, good = _token(owner, sock)
    s = socket.create_connection((host, port), timeout=20)
    s.sendall(good if token is None else token)
    if token is None:
        assert s.recv(1) == b"\x01"  # served
    return s


def _reply(s) -> tuple[int, bytes]:
    code, _, n = struct.unpack("<BBH", _recv(s, 4))
    return code, _recv(s, n)


def _read(s, addr: int, n: int) -> bytes:
    s.sendall(HEAD.pack(b"kvtS", READ, 0, 0, 1) + rows((addr, n, 0)))
    code, text = _reply(s)
    assert code == 0, text
    return _recv(s, n)


def _closed(s) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True


def _assert_stream_serves(owner, sock) -> None:
    with _stream(owner, sock) as s:
        assert _read(s, owner.base + 4096, 4096) == PATTERN[4096:8192].tobytes()


def test_honest_stream_reads_registered_bytes(owner, sock):
    _assert_stream_serves(owner, sock)


def test_unknown_and_reused_tokens_get_the_connection_closed(owner, sock):
    with _stream(owner, sock, secrets.token_bytes(16)) as s:
        assert _closed(s)
    host, port, token = _token(owner, sock)
    with socket.create_connection((host, port), timeout=20) as first:
        first.sendall(token)
        assert first.recv(1) == b"\x01"
        assert _read(first, owner.base, 16) == PATTERN[:16].tobytes()
        with socket.create_connection((host, port), timeout=20) as second:
            second.sendall(token)
            assert _closed(second)
    assert_unharmed(owner, sock)


@pytest.mark.parametrize("op", [READ, WRITE])
def test_rows_outside_registrations_are_refused_and_the_stream_stays_in_step(owner, sock, op):
    with _stream(owner, sock) as s:
        bad = owner.base + REGION  # just past the registered region: the guard bytes
        s.sendall(HEAD.pack(b"kvtS", op, 0, 0, 1) + rows((bad, 4096, 0)) + (b"\xee" * 4096 if op == WRITE else b""))
        code, text = _reply(s)
        assert code == 2 and b"did not register" in text  # out_of_region
        assert _read(s, owner.base + 4096, 4096) == PATTERN[4096:8192].tobytes()  # still in step
    assert_unharmed(owner, sock)


@pytest.mark.parametrize("addr,n", [(2**64 - 4096, 4096), ("base", 2**64 - 1), ("base", 0)])
def test_wrapping_and_empty_rows_are_refused(owner, sock, addr, n):
    with _stream(owner, sock) as s:
        s.sendall(HEAD.pack(b"kvtS", READ, 0, 0, 1) + rows((owner.base if addr == "base" else addr, n, 0)))
        code, _ = _reply(s)
        assert code == 1  # bad_request
    assert_unharmed(owner, sock)


@pytest.mark.parametrize("head", [
    HEAD.pack(b"nope", READ, 0, 0, 1), HEAD.pack(b"kvtS", 9, 0, 0, 1), HEAD.pack(b"kvtS", READ, 99, 0, 1),
    HEAD.pack(b"kvtS", READ, 0, 0, 0), HEAD.pack(b"kvtS", READ, 0, 0, 2**32 - 1),
])
def test_malformed_request_drops_only_that_connection(owner, sock, head):
    with _stream(owner, sock) as s:
        s.sendall(head)
        assert _closed(s)
    _assert_stream_serves(owner, sock)
    assert_unharmed(owner, sock)


def test_refused_write_declaring_an_impossible_payload_is_hung_up(owner, sock):
    with _stream(owner, sock) as s:
        s.sendall(HEAD.pack(b"kvtS", WRITE, 0, 0, 2) + rows((1 << 40, 2**63, 0), (1 << 41, 2**63, 0)))
        assert _closed(s)
    assert_unharmed(owner, sock)


@pytest.mark.parametrize("n", [65536, REGION])  # staged; received straight into memory (MSG_WAITALL)
def test_peer_that_stalls_or_lies_mid_write_costs_only_its_own_connection(owner, sock, n):
    stalled = _stream(owner, sock)
    try:  # a WRITE of n bytes (the region's own bytes: they may land) that stops after 1 KiB
        stalled.sendall(HEAD.pack(b"kvtS", WRITE, 0, 0, 1) + rows((owner.base, n, 0)) +
                        PATTERN[:1024].tobytes())
        _assert_stream_serves(owner, sock)  # others are served meanwhile
        assert_unharmed(owner, sock)
    finally:
        stalled.close()  # the lie ends: the owner's reader sees the stream close mid-payload
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and owner.ask("check") != (True, True):
        time.sleep(0.1)
    _assert_stream_serves(owner, sock)
    assert_unharmed(owner, sock)


def test_connection_flood_is_capped_and_the_owner_recovers(owner, sock):
    host, port, _ = _token(owner, sock)
    flood = [socket.create_connection((host, port), timeout=20) for _ in range(80)]
    try:
        assert owner.ask("check") == (True, True)
    finally:
        for s in flood:
            s.close()
    _assert_stream_serves(owner, sock)
    assert_unharmed(owner, sock)


@pytest.fixture
def own_owner():
    """An owner of this test's own (the module's is shared)."""
    import zmq
    from kvt.agent import fetch_info
    from kvt.wire import decode
    from kvt_host.protocol import HostMetadata
    from owner import owner_process

    with owner_process({"timeout": 10}) as o:
        o.data = decode(fetch_info(o.endpoint, "attacker", 10).metadata, HostMetadata).endpoint
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 20_000)
        s.connect(o.data)
        try:
            yield o, s
        finally:
            s.close()


def test_no_byte_of_a_stalled_write_lands_after_the_owner_deregistered(own_owner):
    """The row check passed, the payload stalls, the owner deregisters and
    reuses the memory: deregister cuts that stream, so the rest of the
    payload never lands (it used to, and into freed memory crash the owner)."""
    owner, sock = own_owner
    with _stream(owner, sock) as s:
        s.sendall(HEAD.pack(b"kvtS", WRITE, 0, 0, 1) + rows((owner.base, REGION, 0)) + b"\xee" * 1024)
        time.sleep(0.5)  # the owner's stream thread is now inside the WRITE, past the check
        assert owner.ask("dereg_reuse")
        try:
            s.sendall(b"\xee" * (REGION - 1024))
        except OSError:
            pass  # the owner hung up already
        assert _closed(s)
    assert owner.ask("private")  # not one attacker byte in memory the owner took back
    assert owner.ask("check")[0]  # guards intact


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_read_replies_to_peers_that_stop_reading_hold_a_piece_each(owner, sock):
    """16 streams each ask a 32 MiB READ (65,536 rows of 512 B over the
    same registered bytes: 1.5 MiB of request) and never read the reply: the
    owner stages a reply a piece at a time, so a stream holds about its
    request, not the reply (each held 32 MiB, 2.3 GB over 64 streams)."""
    n = 65_536
    r = np.zeros((n, 3), np.uint64)
    r[:, 0] = owner.base + np.arange(n, dtype=np.uint64) % 512 * 512
    r[:, 1] = 512
    ask_all = HEAD.pack(b"kvtS", READ, 0, 0, n) + r.tobytes()
    before, streams = _rss(owner.proc.pid), []
    try:
        for _ in range(16):
            streams.append(_stream(owner, sock))
            streams[-1].sendall(ask_all)
        time.sleep(2)  # every stream's reply staged as far as it goes
        grown = _rss(owner.proc.pid) - before
    finally:
        for s in streams:
            s.close()
    assert grown < 160 << 20, f"{grown >> 20} MiB held for 16 streams that do not read"
    _assert_stream_serves(owner, sock)
    assert_unharmed(owner, sock)


def test_a_token_trickled_in_is_hung_up_after_the_hello_timeout(owner, sock):
    host, port, token = _token(owner, sock)
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=20) as s:
        for b in token:  # a byte a second: under a per-recv timeout this held the slot for 16 s
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            if time.monotonic() - t0 > 12:
                break
            time.sleep(1)
        assert _closed(s)
    assert time.monotonic() - t0 < 12  # _HELLO_TIMEOUT is 5 s in all


def test_idle_unauthenticated_connections_leave_honest_transfers_working(owner, sock):
    """A flood of connections that never present a token takes no served
    slot: honest peers' transfers go through (in ZMQ messages while the hello
    slots are full) and get the right bytes."""
    from kvt import Agent

    host, port, _ = _token(owner, sock)
    flood = [socket.create_connection((host, port), timeout=20) for _ in range(100)]
    try:
        with Agent(name="honest", backend="host", options={"transport": "tcp", "timeout": 10}) as a:
            peer = a.connect(owner.endpoint)
            buf = np.zeros(REGION, np.uint8)
            a.register_blocks("kv", [buf.reshape(64, -1)])
            a.read_blocks(peer, [1, 2], [1, 2]).wait(20)
            assert np.array_equal(buf[4096:3 * 4096], PATTERN[4096:3 * 4096])
    finally:
        for s in flood:
            s.close()
    _assert_stream_serves(owner, sock)
    assert_unharmed(owner, sock)


@pytest.mark.parametrize("n", [64 << 10, 1 << 20])  # staged; received straight into memory (MSG_WAITALL)
@pytest.mark.parametrize("end", ["timeout", "release"])
def test_a_trickling_owner_ends_the_read_and_nothing_lands_after(end, n):
    """An owner (reached through its metadata) that answers a READ and then
    trickles its payload a byte at a time: the read ends ERR at its timeout,
    or at release, and no byte lands in our memory after that."""
    import threading

    import zmq
    from kvt.errors import TransferTimeout
    from kvt.types import Descs, Op
    from kvt.wire import decode, encode
    from kvt_host.backend import HostBackend
    from kvt_host.protocol import HostMetadata, Reply, Request

    stop = threading.Event()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    zport = router.bind_to_random_port("tcp://127.0.0.1")
    listener = socket.create_server(("127.0.0.1", 0))

    def slow_owner():
        ident, frame = router.recv_multipart()
        router.send_multipart([ident, encode(Reply(id=decode(frame, Request).id, port=listener.getsockname()[1],
                                                   token=b"t" * 16))])
        c, _ = listener.accept()
        with c:
            _recv(c, 16)
            c.sendall(b"\x01")
            _recv(c, HEAD.size + 24)
            c.sendall(struct.pack("<BBH", 0, 0, 0))
            try:
                while not stop.wait(0.25):
                    c.sendall(b"\x66")
                c.sendall(b"\x77" * n)  # the rest, all at once: none of it may land
            except OSError:
                pass  # cut: good

    owner_thread = threading.Thread(target=slow_owner, daemon=True)
    owner_thread.start()
    b = HostBackend("victim", {"timeout": 2, "transport": "tcp"})
    try:
        local = np.zeros(n, np.uint8)
        b.register(Descs.from_buffers([local]))
        md = HostMetadata(name="slow", endpoint=f"tcp://127.0.0.1:{zport}", host_id="elsewhere", pid=4242,
                          start_time=1, regions={"DRAM": np.array([[1 << 40, n, 0]], np.uint64).tobytes()})
        peer = b.add_remote(encode(md))
        h = b.transfer(Op.READ, b.prep(None, Descs.from_buffers([local])), [0],
                       b.prep(peer, Descs(np.array([[1 << 40, n, 0]], np.uint64))), [0])
        t0 = time.monotonic()
        if end == "timeout":
            state = b.wait(h, 10)
            assert state.failed and isinstance(state.cause, TransferTimeout), state
            assert time.monotonic() - t0 < 5
        else:
            time.sleep(1)
            b.release(h)
            assert time.monotonic() - t0 < 3  # release did not wait out the owner
        landed = local.copy()
        stop.set()
        owner_thread.join(10)
        time.sleep(0.5)
        assert np.array_equal(local, landed) and not (local == 0x77).any()
    finally:
        stop.set()
        b.close()
        router.close()
        listener.close()


def test_an_idle_stream_is_closed_and_its_slot_given_back(monkeypatch):
    """Idle served streams used to keep their slots for good: 64 of them took
    every slot and honest peers fell back to ZMQ messages."""
    from kvt_host import stream

    monkeypatch.setattr(stream, "_IDLE", 0.5)
    server = stream.StreamServer("127.0.0.1", None, None, timeout=10)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
            s.sendall(server.issue("idler"))
            assert s.recv(1) == b"\x01"
            assert len(server._conns) == 1
            assert _closed(s)  # within the socket's 20 s; the owner hangs up after 0.5 s
        deadline = time.monotonic() + 5
        while server._conns and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server._conns
    finally:
        server.close()


def test_an_honest_stream_idle_past_the_owners_limit_is_reopened_not_failed(monkeypatch):
    from kvt import Agent
    from kvt_host import stream

    monkeypatch.setattr(stream, "_IDLE", 0.6)
    opts = {"transport": "tcp", "timeout": 10}
    with Agent(name="owner", backend="host", options=opts) as owner, \
            Agent(name="reader", backend="host", options=opts) as reader:
        src = (np.arange(64 * 4096) % 251).astype(np.uint8)
        dst = np.zeros_like(src)
        owner.register_blocks("kv", [src.reshape(64, -1)])
        reader.register_blocks("kv", [dst.reshape(64, -1)])
        peer = reader.connect(owner.listen())
        reader.read_blocks(peer, [1], [1]).wait(20)
        first = reader.backend._peers[peer].stream
        assert first is not None  # the bytes went over a stream
        time.sleep(1.0)  # the owner closed it meanwhile
        reader.read_blocks(peer, [2, 3], [2, 3]).wait(20)
        assert reader.backend._peers[peer].stream is not first
        assert np.array_equal(dst[4096:4 * 4096], src[4096:4 * 4096])


class _Trickle:
    """A peer's socket that moves one byte (or one ``sendall``) per call,
    each 0.5 ms later on its clock, which the test makes the stream
    module's: a peer that always answers well within a receive's timeout."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def settimeout(self, t) -> None:
        assert t is None or t > 0

    def recv_into(self, view, *_) -> int:
        self.now += 0.0005
        view[0] = 0x66
        return 1

    def sendall(self, data) -> None:
        self.now += 0.0005


@pytest.mark.parametrize("loop", ["recv_exact", "recv_rows", "discard", "send_rows"])
def test_every_stream_loop_ends_at_its_deadline_however_fast_a_peer_trickles(loop, monkeypatch):
    """Each receive (and send) used to get max(time left, 1 ms) as its
    timeout, and no loop looked at the deadline itself: a peer sending a
    byte within every 1 ms kept a request going for good, on the initiator
    (a READ with ``timeout`` 1 s took 9 s) and on the owner's stream threads
    alike.  Now the time is up at the deadline (``socket.timeout``, which
    the initiator reports as ``TransferTimeout``)."""
    from types import SimpleNamespace

    from kvt_host import stream

    peer = _Trickle()
    monkeypatch.setattr(stream, "time", SimpleNamespace(monotonic=peer.monotonic))
    deadline = peer.now + 0.01  # 20 of the peer's bytes
    buf = np.zeros(64 << 10, np.uint8)  # staged: shorter than stream._DIRECT
    row = np.array([[buf.ctypes.data, 4096]], np.uint64)
    run = {"recv_exact": lambda: stream._recv_exact(peer, memoryview(buf), deadline),
           "recv_rows": lambda: stream.recv_rows(peer, np.array([[buf.ctypes.data, 4096]] * 16, np.uint64),
                                                 deadline),
           "discard": lambda: stream._discard(peer, len(buf), deadline),
           "send_rows": lambda: [stream.send_rows(peer, row, deadline) for _ in range(100)]}[loop]
    with pytest.raises(socket.timeout):
        run()
    assert peer.now <= deadline + 0.0005  # no call began past the deadline (a fake clock: no real time measured)


@pytest.mark.parametrize("loop", ["recv_exact", "recv_waitall", "discard", "send_all"])
def test_a_deadline_already_passed_moves_no_byte(loop):
    """The real socket, with the bytes already waiting: past its deadline a
    call takes none of them (it used to take them, with 1 ms to do it)."""
    from kvt_host import stream

    a, b = socket.socketpair()
    with a, b:
        n = 4096 if loop != "recv_waitall" else stream._DIRECT  # (that one's bytes go straight into memory)
        a.sendall(b"\x66" * 4096)  # waiting in b's buffer
        past = time.monotonic() - 1
        buf = bytearray(n)
        run = {"recv_exact": lambda: stream._recv_exact(b, memoryview(buf), past),
               "recv_waitall": lambda: stream._recv_exact(b, memoryview(buf), past),
               "discard": lambda: stream._discard(b, n, past),
               "send_all": lambda: stream._send_all(b, b"\x77" * 16, past)}[loop]
        with pytest.raises(socket.timeout):
            run()
        assert not any(buf)
        a.settimeout(0)
        with pytest.raises(BlockingIOError):
            a.recv(16)  # nothing was sent
        b.settimeout(0)
        assert b.recv(8192) == b"\x66" * 4096  # nothing was taken


def test_a_header_trickled_in_is_hung_up_after_the_idle_time_in_all(monkeypatch):
    """The next request's header has ``_IDLE`` seconds in all: it had that
    per byte, so a header trickled a byte every few seconds kept a served
    slot for minutes."""
    from kvt_host import stream

    monkeypatch.setattr(stream, "_IDLE", 0.5)
    server = stream.StreamServer("127.0.0.1", None, None, timeout=10)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
            s.sendall(server.issue("trickler"))
            assert s.recv(1) == b"\x01"
            head, sent = HEAD.pack(b"kvtS", READ, 0, 0, 1), 0
            for byte in head[:-1]:  # a byte every 0.15 s: each well within _IDLE
                if not server._conns:
                    break  # hung up, before the header was complete
                s.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.15)
            assert sent < len(head) - 1
            assert _closed(s)
    finally:
        server.close()
