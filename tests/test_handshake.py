import socket
import time

import pytest
import zmq

from kvt import Agent
from kvt.errors import HandshakeError, HandshakeTimeout, IncompatiblePeer, InvalidArgument, WireError
from kvt.handshake import HandshakeServer, request
from kvt.wire import AgentInfo, HandshakeReply, decode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_round_trip_and_binds_loopback_by_default():
    with HandshakeServer(lambda body: body[::-1]) as srv:
        assert srv.endpoint.startswith("tcp://127.0.0.1:")
        assert request(srv.endpoint, b"abc", timeout=5) == b"cba"


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
