"""The host backend's same-host notification socket (kvt_host.notifs): what
goes over it, in what order, and what its owner refuses."""

import ctypes
import os
import socket
import time

import numpy as np
import pytest

from kvt import Agent
from kvt.config import Config
from kvt.wire import decode, encode
from kvt_host.notifs import ADMITTED, MAX_CONNECTIONS, MAX_FRAME, NotifLink, valid_name
from kvt_host.protocol import HostMetadata, Request

from peer import BLOCK, NUM_BLOCKS, peer_process


def _until(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := pred()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def _collect(get, sender: str, n: int) -> list[bytes]:
    got, deadline = [], time.monotonic() + 20
    while len(got) < n and time.monotonic() < deadline:
        got += get().get(sender, [])
    return got


@pytest.fixture
def pair():
    """Us, and a peer in another process on this host with its KV in shared segments."""
    with peer_process(shared=True) as peer, Agent(name="me", options={"timeout": 5}) as me:
        local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [local])
        name = me.connect(peer.endpoint, timeout=10)
        yield me, me.backend._peers[name], peer


def test_a_burst_of_copies_notifies_on_the_posting_thread_in_order_and_never_opens_zmq(pair, monkeypatch):
    """Hundreds of reads posted back to back, far more than the kernel's queue
    of ten datagrams: each one's notification goes from the thread that
    posted it (none is handed to the lane's worker), over the socket.  The
    very first may go through the worker: the link sends nothing before the
    owner admitted its connection (test_notifications_to_an_owner_that_turns_the_sender_away_go_over_zmq),
    and a post does not wait for that."""
    me, p, peer = pair
    me.notify(p.name, b"hello")
    assert _collect(peer.notifs, "me", 1) == [b"hello"]
    assert p.link is not None and p.link.admitted
    handed, real = [], me.backend._send_notif
    monkeypatch.setattr(me.backend, "_send_notif", lambda q, m: (handed.append(m), real(q, m))[1])
    for i in range(400):
        with me.read_blocks(p.name, [i % NUM_BLOCKS], [i % NUM_BLOCKS], notif=b"r%d" % i) as x:
            x.wait(10)
    assert _collect(peer.notifs, "me", 400) == [b"r%d" % i for i in range(400)]
    assert handed == []
    assert p.link is not None and p._sock is None  # ZMQ's socket to the peer was never needed


def test_a_notification_too_large_for_the_socket_moves_the_peer_to_zmq_after_the_earlier_ones(pair):
    """The earlier small ones sit unread in the peer's socket (it reads it when
    asked, or every 0.1 s: it just did); the large one, over ZMQ, must not
    overtake them."""
    me, p, peer = pair
    big = b"B" * (MAX_FRAME + 1)
    msgs = [b"s%d" % i for i in range(20)] + [big] + [b"t%d" % i for i in range(20)]
    me.notify(p.name, b"first")
    assert _collect(peer.notifs, "me", 1) == [b"first"]
    for m in msgs:
        me.notify(p.name, m)
    time.sleep(0.5)  # the large one is in the peer's inbox by now, the small ones before it still in its socket
    assert _collect(peer.notifs, "me", len(msgs)) == msgs
    assert p.link is None and p.notifs_on_zmq


def test_notifications_nobody_asks_for_leave_the_socket_for_the_inbox():
    """Messages do not stay in the kernel while the owner never calls
    get_notifs: its server thread moves them to its bounded inbox."""
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        a.add_peer(b.info())
        link = a.backend._peers["b"].link
        assert link is not None
        a.notify("b", b"hello")
        # (the inbox, not get_notifs, which would read the socket itself)
        assert _until(lambda: b.backend._inbox._count == 1, 5)
        assert link.admitted and link.unread() == 0  # it came over the socket
        assert b.backend._inbox.take() == {"a": [b"hello"]}


class _RecordingEpoll:
    """The listener's epoll object, counting the polls that go through
    ``select`` (which let go of the GIL)."""

    def __init__(self, ep):
        self._ep, self.polls = ep, 0

    def poll(self, *args):
        self.polls += 1
        return self._ep.poll(*args)

    def __getattr__(self, name):
        return getattr(self._ep, name)


@pytest.mark.parametrize("gil_holding", [True, False], ids=["ctypes", "select-fallback"])
def test_asking_when_nothing_waits_keeps_the_gil(gil_holding, monkeypatch):
    """An engine asks every step.  With nothing waiting, get_notifs finds so
    by a zero-timeout epoll_wait through ctypes.PyDLL, which keeps the GIL: a
    call that let go of it each step starved the process's other threads (a
    tcp READ's worker waited seconds per step under vLLM;
    benchmarks/bench_step_poll.py).  Messages that do wait are read as
    before, and where libc cannot be loaded ``select`` does it all."""
    from kvt_host import notifs

    if gil_holding:
        assert notifs._epoll_wait._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # PyDLL's: called holding the GIL
    else:
        monkeypatch.setattr(notifs, "_epoll_wait", None)
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        a.add_peer(b.info())
        listener = b.backend._server.notifs
        with listener._lock:
            listener._ready = rec = _RecordingEpoll(listener._ready)
        for _ in range(100):
            assert b.get_notifs() == {}
        assert rec.polls == (0 if gil_holding else 100)
        a.notify("b", b"hello")
        assert _collect(b.get_notifs, "a", 1) == [b"hello"]
        assert rec.polls > (0 if gil_holding else 100)
        assert a.backend._peers["b"].link._sock is not None  # it came over the socket, not ZMQ


@pytest.mark.parametrize("name", ["", "@/tmp/.X11-unix/X0", "/tmp/kvt", "kvt-notif-1-" + "0" * 15,
                                  "kvt-notif-1-" + "0" * 16 + "\0x", "kvt-notif-12345678-" + "0" * 16, 7])
def test_metadata_naming_any_other_socket_is_ignored_and_notifications_take_zmq(name):
    assert not valid_name(name)
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        md = decode(b.backend.local_metadata(), HostMetadata)
        assert valid_name(md.notif)
        a.backend.add_remote(encode(HostMetadata(**{**{f: getattr(md, f) for f in md.__struct_fields__},
                                                    "notif": name if isinstance(name, str) else ""})))
        assert a.backend._peers["b"].link is None
        a.notify("b", b"over zmq")
        assert _collect(b.get_notifs, "a", 1) == [b"over zmq"]


def test_a_socket_nobody_listens_on_sends_the_peer_to_zmq():
    """E.g. the owner in another network namespace (abstract sockets are per namespace)."""
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        md = decode(b.backend.local_metadata(), HostMetadata)
        fields = {f: getattr(md, f) for f in md.__struct_fields__}
        a.backend.add_remote(encode(HostMetadata(**{**fields, "notif": f"kvt-notif-1-{os.urandom(8).hex()}"})))
        a.notify("b", b"one")
        a.notify("b", b"two")
        assert _collect(b.get_notifs, "a", 2) == [b"one", b"two"]
        assert a.backend._peers["b"].link is None


def test_with_an_auth_key_notifications_stay_on_the_authenticated_channel():
    key = "test-shared-key-0123456789abcdef"
    with Agent(name="a", config=Config(auth_key=key)) as a, Agent(name="b", config=Config(auth_key=key)) as b:
        assert decode(b.backend.local_metadata(), HostMetadata).notif == ""
        assert b.backend._server.notifs is None
        a.add_peer(b.info())
        assert a.backend._peers["b"].link is None
        a.notify("b", b"sealed")
        assert _collect(b.get_notifs, "a", 1) == [b"sealed"]


# -- hostile senders: every byte checked, the owner serves on ------------------------------


def _connect(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    s.connect(b"\0" + name.encode())
    return s


def _notif(sender: str, msg: bytes, op: str = "NOTIF") -> bytes:
    return encode(Request(id=0, sender=sender, op=op, msg=msg))


def test_hostile_messages_are_dropped_a_bad_connection_cut_and_the_owner_serves_on():
    with Agent(name="b", options={"timeout": 5}) as b:
        name = b.backend._server.notifs.name
        s = _connect(name)
        for bad in (b"\xff" * 40, _notif("x", b"read", op="READ"), _notif("x", b"", op="STREAM"),
                    _notif("x" * 10_000, b"long name"),
                    _notif("x", b"m" * (b.backend.capabilities.max_notif_bytes + 1))[:MAX_FRAME]):
            s.send(bad)
        s.send(_notif("x", b"fine"))
        s.send(b"O" * (MAX_FRAME + 1))  # over the limit: the connection is cut
        s.send(_notif("x", b"after the cut"))
        assert _collect(b.get_notifs, "x", 1) == [b"fine"]
        assert _until(lambda: b.backend._server.notifs.refused == 1)
        assert b.backend._server._stream is None  # the STREAM request opened nothing
        time.sleep(0.2)
        assert b.get_notifs() == {}
        s.close()
        s = _connect(name)  # a new connection is served
        s.send(_notif("x", b"again"))
        assert _collect(b.get_notifs, "x", 1) == [b"again"]
        s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another user")
def test_another_users_connection_is_turned_away():
    with Agent(name="b", options={"timeout": 5}) as b:
        name = b.backend._server.notifs.name
        pid = os.fork()
        if pid == 0:  # another user, same host: abstract sockets have no file permissions
            try:
                os.setuid(65534)
                _connect(name).send(_notif("intruder", b"forged"))
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert _until(lambda: b.backend._server.notifs.refused == 1)
        s = _connect(name)
        s.send(_notif("friend", b"mine"))
        assert _collect(b.get_notifs, "friend", 1) == [b"mine"]
        assert "intruder" not in b.get_notifs()
        s.close()


def test_connections_past_the_limit_are_turned_away_and_those_within_it_served():
    with Agent(name="b", options={"timeout": 5}) as b:
        name = b.backend._server.notifs.name
        conns = [_connect(name) for _ in range(MAX_CONNECTIONS + 1)]
        try:
            assert _until(lambda: b.backend._server.notifs.refused == 1)
            for c in conns:
                c.settimeout(10)
            # the kept ones hear ADMITTED, the one too many (accepted in order: the last) a close
            assert [c.recv(1) for c in conns] == [ADMITTED] * MAX_CONNECTIONS + [b""]
            conns[0].send(_notif("first", b"served"))
            assert _collect(b.get_notifs, "first", 1) == [b"served"]
        finally:
            for c in conns:
                c.close()


def test_notifications_to_an_owner_that_turns_the_sender_away_go_over_zmq():
    """Another process of our user holds every one of the owner's connections.
    The kernel still takes a new connection into the listening socket's
    backlog, and messages on it, until the owner accepts and closes it: the
    link used to send there at once, see no error, and lose every message
    (found by a red-team pass).  It now waits for the owner's ADMITTED byte,
    which never comes, and everything goes over ZMQ, in order, both what
    ``notify`` sends and what a copy posted on this thread attaches."""
    with Agent(name="a", options={"timeout": 5}) as a, Agent(name="b", options={"timeout": 5}) as b:
        src = np.arange(8 * 4096, dtype=np.uint8).reshape(8, -1)
        dst = np.zeros_like(src)
        b.register_blocks("kv", [src])
        a.register_blocks("kv", [dst])
        listener = b.backend._server.notifs
        hog = [_connect(listener.name) for _ in range(MAX_CONNECTIONS)]
        try:
            assert _until(lambda: len(listener._conns) == MAX_CONNECTIONS)
            peer = a.connect(b.listen(), timeout=10)
            assert a.backend._peers[peer].link is not None  # it would try the socket
            sent = []
            for i in range(3):
                sent.append(b"n%d" % i)
                a.notify(peer, sent[-1])
            for i in range(2):
                sent.append(b"r%d" % i)
                with a.read_blocks(peer, [i], [i], notif=sent[-1]) as x:
                    x.wait(10)
            for i in range(3, 6):
                sent.append(b"n%d" % i)
                a.notify(peer, sent[-1])
            assert _collect(b.get_notifs, "a", len(sent)) == sent
            assert a.backend._peers[peer].link is None and a.backend._peers[peer].notifs_on_zmq
            assert listener.refused >= 1
            assert np.array_equal(dst[:2], src[:2])
        finally:
            for s in hog:
                s.close()


def _fake_owner() -> tuple[socket.socket, str]:
    """A listening socket under a name a link accepts, whose owner (the test) accepts by hand."""
    name = f"kvt-notif-{os.getpid()}-{os.urandom(8).hex()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(b"\0" + name.encode())
    srv.listen(4)
    srv.settimeout(10)
    return srv, name


def test_a_link_sends_nothing_before_the_owner_admits_it():
    srv, name = _fake_owner()
    with srv:
        link = NotifLink(name)
        try:
            assert link.send(b"early", None) is False  # connected, not admitted: the caller's worker takes it
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(0)
                with pytest.raises(BlockingIOError):
                    conn.recv(100)  # nothing was put on the connection before admission
                conn.send(ADMITTED)
                assert link.send(b"late", 10) is True
                assert not link.send(b"x" * (MAX_FRAME + 1), None)  # (too large: ZMQ's, as before)
                conn.settimeout(10)
                assert conn.recv(100) == b"late"
                assert link.admitted and link.send(b"hot", None) is True  # once admitted, on the posting thread
                assert conn.recv(100) == b"hot"
        finally:
            link.close()


@pytest.mark.parametrize("owner", ["closes", "never_answers", "answers_garbage"])
def test_a_link_the_owner_does_not_admit_carries_nothing_and_says_so(owner):
    """False: the backend sends this message and every later one over ZMQ,
    with none of them left behind on the socket."""
    srv, name = _fake_owner()
    with srv:
        link = NotifLink(name)
        try:
            assert link.send(b"one", None) is False
            conn, _ = srv.accept()
            with conn:
                if owner == "closes":
                    conn.close()
                elif owner == "answers_garbage":
                    conn.send(b"\x00")
                assert link.send(b"two", 0.3 if owner == "never_answers" else 10) is False
                assert not link.admitted
                assert link.send(b"three", 10) is False  # for good
                if owner != "closes":
                    conn.settimeout(10)
                    assert conn.recv(100) == b""  # the link hung up, and none of them went on the socket
        finally:
            link.close()
