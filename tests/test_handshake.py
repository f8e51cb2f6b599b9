import socket
import time

import msgspec
import pytest
import zmq

from kvt import Agent
from kvt.errors import HandshakeError, HandshakeTimeout, IncompatiblePeer, InvalidArgument, WireError
from kvt.handshake import HandshakeServer, RouterServer, request
from kvt.wire import AgentInfo, HandshakeReply, decode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_round_trip_and_binds_loopback_by_default():
    with HandshakeServer(lambda body: body[::-1]) as srv:
        assert srv.endpoint.startswith("tcp://127.0.0.1:")
        assert request(srv.endpoint, b"abc", timeout=5) == b"cba"


def test_a_watched_fd_and_the_tick_are_served_on_the_server_thread_and_their_failures_stop_nothing():
    import os
    r, w = os.pipe()
    seen, ticks = [], []

    def ready():
        seen.append(os.read(r, 1))
        if seen[-1] == b"x":
            raise RuntimeError("watcher bug")

    srv = RouterServer(lambda frames: [b"echo"] + frames)
    srv.watch(r, ready)
    srv.tick = lambda: (ticks.append(1), 1 / 0)
    with srv:
        for c in b"axb":
            os.write(w, bytes([c]))
            deadline = time.monotonic() + 5
            while len(seen) < b"axb".index(c) + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(srv.endpoint)
        s.send_multipart([b"hi"])
        assert s.recv_multipart() == [b"echo", b"hi"]  # served on after both raised
        s.close()
    assert seen == [b"a", b"x", b"b"] and len(ticks) >= 3
    os.close(r)
    os.close(w)


def test_failing_provider_does_not_stop_the_server():
    def provider(body):
        if body == b"bad":
            raise RuntimeError("provider bug")
        return b"ok"

    with HandshakeServer(provider) as srv:
        assert request(srv.endpoint, b"bad", timeout=5) == b""
        assert request(srv.endpoint, b"good", timeout=5) == b"ok"


def test_silent_peer_times_out_within_the_timeout():
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        t = time.monotonic()
        with pytest.raises(HandshakeTimeout, match="within 0.5s"):
            request(f"tcp://127.0.0.1:{port}", b"x", timeout=0.5)
        assert time.monotonic() - t < 3  # bounded, not hung
    finally:
        silent.close(linger=0)


def test_absent_peer_times_out():
    with pytest.raises(HandshakeTimeout):
        request(f"tcp://127.0.0.1:{_free_port()}", b"x", timeout=0.3)


def test_bad_endpoint_is_handshake_error():
    with pytest.raises(HandshakeError):
        request("not-an-endpoint", b"x", timeout=1)
    with pytest.raises(InvalidArgument):
        request("tcp://127.0.0.1:1", b"x", timeout=0)


def test_agents_exchange_info_through_the_side_channel():
    with Agent(name="a") as a, Agent(name="b") as b:
        import numpy as np
        a.register_blocks("kv", [np.zeros((4, 64), np.uint8)])
        a.extra["model"] = "toy"
        peer = b.connect(a.listen(), timeout=5)
        info = b.peer_info(peer)
        assert peer == "a" and info.extra == {"model": "toy"}
        assert info.layouts["kv"].num_blocks == 4 and info.layouts["kv"].block_len == 64


def test_agent_server_answers_malformed_requests_and_keeps_serving():
    with Agent(name="a") as a, Agent(name="b") as b:
        ep = a.listen()
        reply = decode(request(ep, b"\x00junk", timeout=5), HandshakeReply)
        assert "WireError" in reply.error
        assert b.connect(ep, timeout=5) == "a"


def test_handshake_with_different_backend_is_refused():
    with Agent(name="a") as a:
        info = a.info()
        other = AgentInfo(name="x", backend="nixl", metadata=info.metadata)
        with pytest.raises(IncompatiblePeer, match="same backend"):
            a.add_peer(other)


def test_malformed_agent_info_is_wire_error():
    with Agent(name="a") as a:
        with pytest.raises(WireError):
            a.add_peer(b"\x92\x01")


def test_timeouts_past_what_zmqs_waits_hold_are_accepted():
    """The config allows timeouts up to ~31 years; ZMQ's waits take an int
    of milliseconds (24.8 days): 35 days raised OverflowError."""
    with HandshakeServer(lambda body: body[::-1]) as srv:
        assert request(srv.endpoint, b"abc", timeout=3e6) == b"cba"


def test_no_socket_left_is_a_handshake_error(monkeypatch):
    """At the open-file limit (peers can hold our fds) ZMQ cannot open a
    socket: a kvt error saying so, not zmq.ZMQError."""
    def no_fd(self, *args, **kwargs):
        raise zmq.ZMQError(24)  # EMFILE

    with HandshakeServer(lambda body: body) as srv:
        monkeypatch.setattr(zmq.Context, "socket", no_fd)
        with pytest.raises(HandshakeError, match="open-file limit"):
            request(srv.endpoint, b"abc", timeout=5)


def test_a_peers_long_texts_are_cut_short_in_our_errors():
    """A peer's error text, or a message's type tag, of megabytes went whole
    into our exceptions (and logs), and a tag back into the reply to it."""
    from kvt.agent import fetch_info
    from kvt.wire import encode

    with HandshakeServer(lambda body: encode(HandshakeReply(error="x" * (4 << 20)))) as srv:
        with pytest.raises(HandshakeError) as e:
            fetch_info(srv.endpoint, "me", 5)
        assert len(str(e.value)) < 2000
    tagged = msgspec.msgpack.encode({"v": 1, "t": "t" * (4 << 20)})
    with pytest.raises(WireError) as e:
        decode(tagged, HandshakeReply)
    assert len(str(e.value)) < 2000


def test_host_names_are_looked_up_by_kvt_within_the_timeout(monkeypatch):
    """ZMQ looks names up on its one I/O thread, blocking every socket of the
    process while a slow DNS answers (a peer can name such a host: in
    kv_transfer_params, discovery records, metadata).  kvt looks names up
    itself, each within its caller's timeout, and hands ZMQ the address."""
    real = socket.getaddrinfo

    def dns(host, *args, **kwargs):
        if host.endswith("nowhere.kvt.test"):
            time.sleep(3 if host.startswith("slow") else 0)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real("127.0.0.1" if host == "peer.kvt.test" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", dns)
    with HandshakeServer(lambda body: body[::-1]) as srv:
        port = srv.endpoint.rsplit(":", 1)[1]
        assert request(f"tcp://peer.kvt.test:{port}", b"abc", timeout=5) == b"cba"
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout, match="looking up"):
            request(f"tcp://slow.nowhere.kvt.test:{port}", b"abc", timeout=0.5)
        assert request(srv.endpoint, b"abc", timeout=5) == b"cba"  # while that lookup still runs
        assert time.monotonic() - t0 < 2.5
    with pytest.raises(HandshakeError, match="cannot look up"):
        request("tcp://nowhere.kvt.test:1", b"abc", timeout=5)
