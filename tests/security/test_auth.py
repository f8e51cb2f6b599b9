"""Peer identity (issue 11 item 5): with ``auth_key`` set, a peer without it
or with a wrong one is dropped in ZMQ's handshake (CURVE keyed from the
secret) on the handshake and the host backend's data channel, and kvt's
clients say so at once; a peer that gets past that layer (it holds the
CURVE keys) but replays or forges kvt.auth messages gets a typed refusal and
nothing else; with the key on both sides everything works (host same-host
and forced TCP, nixl, ucx); the key never shows in logs, reprs or errors.

The owner runs in its own process (tests/security/owner.py); attackers speak
ZMQ directly over real sockets."""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message
from kvt import Agent
from kvt.agent import fetch_info
from kvt.auth import ClientSession, Secret
from kvt.config import load_config
from kvt.errors import AuthenticationError, HandshakeError, KvtError, TransferTimeout
from kvt.handshake import curve_client, request
from kvt.wire import HandshakeReply, HandshakeRequest, decode, encode
from kvt_host.protocol import HostMetadata, Reply, Request
from owner import REGION, owner_process

KEY = "test-shared-key-0123456789abcdef"
WRONG = "someone-elses-key-0123456789abcd"
RECV_MS = 20_000
EXPECT = (np.arange(REGION) * 7 % 251).astype(np.uint8)


@pytest.fixture(scope="module")
def owner():
    with owner_process({"timeout": 10}, auth_key=KEY) as o:
        o.data = decode(o.ask("metadata"), HostMetadata).endpoint
        yield o


def dealer(endpoint: str, curve: str | None = KEY) -> zmq.Socket:
    """A raw DEALER; with ``curve`` (a key), past ZMQ's CURVE handshake as a key holder's would be."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, RECV_MS)
    if curve is not None:
        curve_client(s, Secret(curve))
    s.connect(endpoint)
    return s


def zmq_handshake(endpoint: str, curve: str | None) -> str:
    """How ZMQ's handshake with ``endpoint`` ends for a raw DEALER (``curve``: as in ``dealer``)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve_client(s, Secret(curve))
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        s.connect(endpoint)
        assert mon.poll(RECV_MS), "no end of ZMQ's handshake"
        return "ok" if recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED else "dropped"
    finally:
        s.disable_monitor()
        mon.close()
        s.close()


def session(sock: zmq.Socket, key: str, covered=None, envelope=()) -> ClientSession:
    """An honest challenge-response (checks the server's proof)."""
    s = ClientSession(Secret(key), covered)
    sock.send_multipart([*envelope, s.hello()])
    s.accept(sock.recv_multipart(), "owner")
    return s


def forged_session(sock: zmq.Socket, key: str, covered=None, envelope=()) -> ClientSession:
    """An attacker's: takes the challenge without checking it and keys the
    session with ``key`` (which is not the owner's)."""
    s = ClientSession(Secret(key), covered)
    sock.send_multipart([*envelope, s.hello()])
    sn = sock.recv_multipart()[-1][-48:-32]
    s._key, s._sid = Secret(key).session_key(s._cn, sn), sn
    return s


def read_req(owner, rid=7, offset=4096) -> bytes:
    rows = np.array([[owner.base + offset, 4096, 0]], np.uint64).tobytes()
    return encode(Request(id=rid, sender="attacker", op="READ", rows=rows))


def leaks(frames: list, owner) -> list[str]:
    """What in ``frames`` would tell an attacker about the owner."""
    blob = b"".join(bytes(f) for f in frames)
    found = []
    for what, needle in (("name", b"owner"), ("pid", str(owner.proc.pid).encode()), ("data endpoint",
                         owner.data.encode()), ("region bytes", EXPECT[4096:4160].tobytes())):
        if needle in blob:
            found.append(what)
    return found


def assert_unharmed(owner):
    """Alive, guards and region intact, and a keyed READ returns the right bytes."""
    assert owner.ask("check") == (True, True)
    sock = dealer(owner.data)
    try:
        s = session(sock, KEY, covered=1)
        frames = [read_req(owner, 11)]
        sock.send_multipart(frames + [s.seal(frames)])
        got = s.open(sock.recv_multipart(), "owner")
        assert decode(got[0], Reply).error == "" and bytes(got[1]) == EXPECT[4096:8192].tobytes()
    finally:
        sock.close()


# -- handshake -------------------------------------------------------------------


@pytest.mark.parametrize("channel", ["handshake", "data"])
def test_peers_without_the_key_are_dropped_in_zmqs_handshake(owner, channel):
    """Nothing such a peer sends reaches the server: not even an unfinished
    multipart message, which ZMQ would hold whole (tests/security/test_dos.py)."""
    endpoint = owner.endpoint if channel == "handshake" else owner.data
    assert zmq_handshake(endpoint, None) == "dropped"
    assert zmq_handshake(endpoint, WRONG) == "dropped"
    assert zmq_handshake(endpoint, KEY) == "ok"
    assert_unharmed(owner)


def test_handshake_without_key_gets_only_a_refusal(owner):
    with pytest.raises(AuthenticationError, match="it has an auth_key"):  # at once, not after the timeout
        fetch_info(owner.endpoint, "attacker", 10)
    # the kvt.auth layer beneath: a message without a session, on a connection past CURVE
    sock = dealer(owner.endpoint)  # raw, as a REQ client would: [b"", request]
    sock.send_multipart([b"", encode(HandshakeRequest(sender="attacker"))])
    got = sock.recv_multipart()
    sock.close()
    rep = decode(got[1], HandshakeReply)
    assert rep.payload == b"" and rep.error.startswith("AuthenticationError:")
    assert leaks(got, owner) == []
    assert_unharmed(owner)


def test_keyless_handshake_reset_before_the_greeting_is_an_authentication_error():
    """Across a real link a keyed server's reset often overtakes its greeting
    (tests/multihost), so a keyless client sees its handshake dropped without
    a mechanism mismatch, several times in a row: that too is
    ``AuthenticationError`` at once, not ``HandshakeTimeout`` at the timeout."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def reset_everyone():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST before any greeting

    t = threading.Thread(target=reset_everyone, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        with pytest.raises(AuthenticationError, match="it has an auth_key"):
            request(f"tcp://127.0.0.1:{srv.getsockname()[1]}", b"x", timeout=10)
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        t.join(5)
        srv.close()


def test_handshake_with_wrong_key_gets_only_a_refusal(owner):
    with pytest.raises(AuthenticationError, match="another auth_key"):  # dropped in ZMQ's handshake
        fetch_info(owner.endpoint, "attacker", 10, Secret(WRONG))
    # past CURVE (as if it held those keys), an attacker sends its request anyway, sealed with its key
    sock = dealer(owner.endpoint)
    s = forged_session(sock, WRONG, envelope=[b""])
    body = encode(HandshakeRequest(sender="attacker"))
    sock.send_multipart([b"", body, s.seal([body])])
    got = sock.recv_multipart()
    sock.close()
    rep = decode(got[1], HandshakeReply)
    assert rep.payload == b"" and "failed authentication" in rep.error
    assert leaks(got, owner) == []
    assert_unharmed(owner)


def test_handshake_replayed_message_is_refused(owner):
    """A recorded, valid handshake request replayed (same or another connection) is refused."""
    sock = dealer(owner.endpoint)
    s = session(sock, KEY, envelope=[b""])
    body = encode(HandshakeRequest(sender="attacker"))
    sealed = [b"", body, s.seal([body])]
    sock.send_multipart(sealed)
    first = s.open(sock.recv_multipart()[1:], "owner")
    assert decode(first[0], HandshakeReply).payload  # the honest one is served
    for again in (sock, dealer(owner.endpoint)):
        again.send_multipart(sealed)
        got = again.recv_multipart()
        rep = decode(got[1], HandshakeReply)
        assert rep.payload == b"" and "replayed" in rep.error
        assert leaks(got, owner) == []
        again.close()
    assert_unharmed(owner)


def test_handshake_with_key_works(owner):
    info = fetch_info(owner.endpoint, "friend", 10, Secret(KEY))
    assert info.name == "owner" and decode(info.metadata, HostMetadata).endpoint == owner.data


# -- host data channel -------------------------------------------------------------


def test_data_request_without_key_is_refused(owner):
    sock = dealer(owner.data)
    sock.send_multipart([read_req(owner)])
    got = sock.recv_multipart()
    rep = decode(got[0], Reply)
    assert rep.id == 7 and rep.code == "unauthenticated" and "set the same auth_key" in rep.error
    assert len(got) == 2 and leaks(got, owner) == []  # the reply and the refusal frame, no data
    owner.ask("notifs")
    sock.send_multipart([encode(Request(id=0, sender="attacker", op="NOTIF", msg=b"spoof"))])
    sock.recv_multipart()  # refused
    sock.close()
    assert owner.ask("notifs") == {}
    assert_unharmed(owner)


def test_data_request_with_wrong_key_is_refused(owner):
    sock = dealer(owner.data)
    s = forged_session(sock, WRONG, covered=1)
    frames = [read_req(owner)]
    sock.send_multipart(frames + [s.seal(frames)])
    got = sock.recv_multipart()
    sock.close()
    rep = decode(got[0], Reply)
    assert rep.code == "unauthenticated" and "failed authentication" in rep.error and leaks(got, owner) == []
    assert_unharmed(owner)


def test_data_replayed_and_forged_messages_are_refused(owner):
    sock = dealer(owner.data)
    s = session(sock, KEY, covered=1)
    frames = [read_req(owner, 21)]
    sealed = frames + [s.seal(frames)]
    sock.send_multipart(sealed)
    assert decode(s.open(sock.recv_multipart(), "owner")[0], Reply).error == ""
    sock.send_multipart(sealed)  # replayed
    got = sock.recv_multipart()
    assert decode(got[0], Reply).code == "unauthenticated" and "replayed" in decode(got[0], Reply).error
    assert leaks(got, owner) == []
    # forged: a valid seal over other rows (the attacker swaps the header of a recorded message)
    frames = [read_req(owner, 22)]
    tag = s.seal(frames)
    sock.send_multipart([read_req(owner, 22, offset=8192), tag])
    got = sock.recv_multipart()
    assert "failed authentication" in decode(got[0], Reply).error and leaks(got, owner) == []
    # a recorded notification replayed is not delivered twice
    owner.ask("notifs")
    note = [encode(Request(id=0, sender="friend", op="NOTIF", msg=b"done"))]
    note.append(s.seal(note))
    sock.send_multipart(note)
    sock.send_multipart(note)
    got = sock.recv_multipart()  # the replay's refusal (the first NOTIF has no reply)
    assert "replayed" in decode(got[0], Reply).error
    assert owner.ask("notifs") == {"friend": [4]}
    sock.close()
    assert_unharmed(owner)


def test_forged_reply_is_refused_by_the_client(owner):
    sock = dealer(owner.data)
    s = session(sock, KEY, covered=1)
    frames = [read_req(owner, 31)]
    sock.send_multipart(frames + [s.seal(frames)])
    got = sock.recv_multipart()
    sock.close()
    for tampered in ([encode(Reply(id=31, error="forged", code="x")), got[1], got[2]],  # another header
                     [got[0], got[1][:-1], got[2]]):  # bulk data of another length
        with pytest.raises(AuthenticationError, match="failed authentication"):
            s.open(tampered, "owner")
    # by design (docs/security.md) the tag covers bulk bytes' length, not their content: integrity checks do
    assert s.open([got[0], b"\0" * 4096, got[2]], "owner")[1] == b"\0" * 4096
    assert s.open(got, "owner")[1] == EXPECT[4096:8192].tobytes()


# -- agents with the key on both sides --------------------------------------------


def agent(backend: str, key: str | None, **options) -> Agent:
    return Agent(config=load_config(backend, options=options, env={"KVT_AUTH_KEY": key} if key else {}))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_host_agents_with_key_work_with_owner_process(owner, transport):
    with agent("host", KEY, transport=transport, timeout=10) as a:
        mine = np.zeros((64, REGION // 64), np.uint8)
        a.register_blocks("kv", [mine])
        peer = a.connect(owner.endpoint)
        a.read_blocks(peer, [0, 1], [1, 2]).wait()
        assert np.array_equal(mine[:2].ravel(), EXPECT[REGION // 64:3 * REGION // 64])
        owner.ask("notifs")
        a.notify(peer, b"hi")
        deadline = time.monotonic() + 10
        while (got := owner.ask("notifs")) == {} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(got.values()) == [[2]]
    assert_unharmed(owner)


def test_host_agent_without_key_is_refused_on_data_path(owner):
    """Metadata obtained some other way (e.g. kv_transfer_params) is no way in: the owner's data server drops
    the keyless connection in ZMQ's handshake, so the READ gets no answer."""
    with agent("host", None, transport="tcp", timeout=2) as a:
        a.register_blocks("kv", [np.zeros((64, REGION // 64), np.uint8)])
        with agent("host", KEY) as friend:  # someone with the key fetched the metadata...
            info = fetch_info(owner.endpoint, "friend", 10, friend.secret)
        peer = a.add_peer(info)
        with pytest.raises(TransferTimeout, match="auth_key"):
            a.read_blocks(peer, [0], [0]).wait(timeout=20)
    assert_unharmed(owner)


def _run_agents(backend: str, case: str) -> None:
    """Each backend in its own process: the nixl and ucx wheels bundle their own libucx (scripts/dev)."""
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "auth_agents.py"), backend, case],
                         capture_output=True, text=True, timeout=240)
    if out.returncode == 3:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.parametrize("backend", ["host", "nixl", "ucx"])
def test_agents_with_key_work_and_without_are_refused(backend):
    """Key on both sides: READ, notification and transfer notification arrive; no key or another key: refused."""
    _run_agents(backend, "works")


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_forged_notifications_are_dropped(backend):
    """On nixl/ucx a notification not sealed with the key, replayed, or sealed with another key never
    reaches get_notifs."""
    _run_agents(backend, "forged")


# -- the key stays secret ------------------------------------------------------------


def test_key_never_shown(owner, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    with agent("host", KEY, transport="tcp", timeout=10) as a:
        shown = [repr(a.config), str(a.config), repr(a.secret), repr(a.backend.options), repr(a.info())]
        try:
            load_config(options={"auth_key": KEY})
        except KvtError as e:
            shown.append(str(e))
        try:
            load_config(env={"KVT_AUTH_KEY": KEY[:10]})
        except KvtError as e:
            shown.append(str(e))
        with agent("host", None, transport="tcp", timeout=10) as c:  # refusals, both ways, logged at debug
            for who in (c, a):
                try:
                    who.connect(owner.endpoint if who is c else c.listen())
                except HandshakeError as e:
                    shown.append(f"{type(e).__name__}: {e}")
        out = subprocess.run([sys.executable, "-m", "kvt.cli", "backends"], capture_output=True, text=True,
                             env={**os.environ, "KVT_AUTH_KEY": KEY}, timeout=120)
        shown += [out.stdout, out.stderr]
    shown.append(caplog.text)
    assert all(KEY not in s and KEY[:10] not in s for s in shown)
    assert len(shown) >= 10 and "AuthenticationError" in " ".join(shown)


def test_notification_seals_use_the_whole_key():
    """Seals were keyed with the raw auth_key cut to 64 bytes: two keys
    sharing their first 64 bytes (key files with a fixed header) accepted
    each other's notifications."""
    from kvt.auth import NotifSeal, Secret

    head = "-----BEGIN FIXED HEADER OF SOME KEY FILE FORMAT-----" + "x" * 12
    sender = NotifSeal(Secret(head + "first-key-tail"), "a")
    same, other = NotifSeal(Secret(head + "first-key-tail"), "b"), NotifSeal(Secret(head + "other-key-tail"), "b")
    assert same.open("a", sender.seal("b", same.incarnation, b"release 42")) == b"release 42"
    assert other.open("a", sender.seal("b", other.incarnation, b"release 42")) is None


def test_notification_seals_keep_a_window_per_receiver_wide_enough_for_reordering():
    """One counter for every receiver, and a 64-message window: a READ's
    notification (sealed at post, sent by NIXL at completion) overtaken by
    64 notifications to other peers, or by 64 to the same peer, was dropped
    as a replay, and the prefill side held its blocks until its abort
    timeout."""
    from kvt.auth import NotifSeal, Secret

    key = Secret("k" * 40)
    a, b, c = NotifSeal(key, "a"), NotifSeal(key, "b"), NotifSeal(key, "c")
    first = a.seal("b", b.incarnation, b"read done")
    for i in range(NotifSeal._WINDOW + 100):  # traffic to another peer meanwhile moves no window of b's
        assert c.open("a", a.seal("c", c.incarnation, b"%d" % i)) == b"%d" % i
    assert b.open("a", a.seal("b", b.incarnation, b"next")) == b"next"
    later = [a.seal("b", b.incarnation, b"later %d" % i) for i in range(1000)]
    assert [b.open("a", m) for m in reversed(later)] == [b"later %d" % i for i in reversed(range(1000))]
    assert b.open("a", first) == b"read done"  # 1,000 behind the newest: inside the window
    assert b.open("a", first) is None and b.open("a", later[5]) is None  # replays still refused
    old = a.seal("b", b.incarnation, b"too old")
    for i in range(NotifSeal._WINDOW):
        b.open("a", a.seal("b", b.incarnation, b"x"))
    assert b.open("a", old) is None  # beyond the window: too old to tell from a replay
