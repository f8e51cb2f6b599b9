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


def test_peer_that_stalls_or_lies_mid_write_costs_only_its_own_connection(owner, sock):
    stalled = _stream(owner, sock)
    try:  # a WRITE of 64 KiB (the region's own bytes: it may land) that stops after 1 KiB
        stalled.sendall(HEAD.pack(b"kvtS", WRITE, 0, 0, 1) + rows((owner.base, 65536, 0)) +
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
