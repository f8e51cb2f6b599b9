"""End-to-end integrity checks (kvt.integrity): off by default, on they catch
a flipped byte as IntegrityError on READ and WRITE, and the digest side
channel refuses nonsense without dying."""

from __future__ import annotations

import numpy as np
import pytest

from kvt import Agent, integrity
from kvt.config import load_config
from kvt.errors import IntegrityError, UnsupportedOperation
from kvt.handshake import request
from kvt.wire import HandshakeReply, decode, encode

from peer import NUM_BLOCKS, BLOCK, pattern, peer_process


def agent(name, on=True, **kw):
    return Agent(name=name, config=load_config(backend="host", options={"timeout": 5, **kw}, name=name,
                                                integrity=on))


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("KVT_INTEGRITY", "1")  # both sides: a peer serves digests only with checks on
    with peer_process("src") as src, agent("me") as me:
        local = np.zeros((NUM_BLOCKS, BLOCK), np.uint8)
        me.register_blocks("kv", [local])
        yield src, me, local, me.connect(src.endpoint, timeout=10)


def test_off_by_default_costs_nothing():
    with Agent(name="a", options={"timeout": 5}) as a:
        assert a.config.integrity is False
        a.register_blocks("kv", [np.zeros((4, 64), np.uint8)])


def test_clean_transfers_verify(pair):
    src, me, local, peer = pair
    with me.read_blocks(peer, [0, 1, 2], [5, 6, 7]) as t:
        assert t.verify is not None
        t.wait(10)
    assert np.array_equal(local[:3], pattern()[5:8])
    local[10:12] = 9
    with me.write_blocks(peer, [10, 11], [1, 2]) as t:
        t.wait(10)


def test_flipped_byte_fails_the_read(pair, monkeypatch):
    src, me, local, peer = pair
    monkeypatch.setenv("KVT_INTEGRITY_TEST_FLIP", "1")  # the test hook: every landed READ gets a byte flipped
    with me.read_blocks(peer, [0, 1], [3, 4]) as t:
        with pytest.raises(IntegrityError, match="differ from the source"):
            t.wait(10)
    monkeypatch.setenv("KVT_INTEGRITY_TEST_FLIP", "0")
    with me.read_blocks(peer, [0, 1], [3, 4]) as t:  # the peer and the agent carry on
        t.wait(10)


def test_write_overwritten_at_the_target_fails(pair, monkeypatch):
    src, me, local, peer = pair
    real = integrity.digest
    # the target's digest of what landed differs from ours (as if a byte flipped on the way)
    monkeypatch.setattr(integrity, "digest", lambda layout, ids: real(layout, ids) ^ np.uint64(1))
    with me.write_blocks(peer, [0], [0]) as t:
        with pytest.raises(IntegrityError):
            t.wait(10)


def test_peer_added_without_a_side_channel_is_refused():
    with agent("a") as a, agent("b") as b:
        for x in (a, b):
            x.register_blocks("kv", [np.zeros((4, 64), np.uint8)])
        peer = a.add_peer(b.info())
        with pytest.raises(UnsupportedOperation, match="connect"):
            a.read_blocks(peer, [0], [0])


@pytest.mark.parametrize("req", [integrity.DigestRequest(layout="nope", block_ids=b""),
                                 integrity.DigestRequest(layout="kv", block_ids=b"\x01\x02\x03"),
                                 integrity.DigestRequest(layout="kv", block_ids=np.array([10**9]).tobytes()),
                                 integrity.DigestRequest(layout="kv", block_ids=np.array([-5]).tobytes()),
                                 # slices of the blocks that are not inside them (the connector's TP reads)
                                 *(integrity.DigestRequest(layout="kv", block_ids=np.array([1]).tobytes(),
                                                           parts=p, offset=o, length=n)
                                   for p, o, n in [(2, 0, 33), (2, 30, 4), (3, 0, 1), (0, 0, 1), (-1, 0, 1),
                                                   (2**40, 0, 1), (64, 0, 1), (2, -1, 2), (2, 0, -8),
                                                   (1, 2**63 - 1, 2**63 - 1)])],
                         ids=lambda r: f"{r.layout}-{len(r.block_ids)}-{r.parts}-{r.offset}-{r.length}")
def test_bad_digest_requests_get_a_typed_refusal(req):
    with agent("a") as a:
        a.register_blocks("kv", [np.zeros((4, 64), np.uint8)])
        endpoint = a.listen()
        reply = decode(request(endpoint, encode(req), 5), HandshakeReply)
        assert reply.error and not reply.payload
        ok = decode(request(endpoint, encode(integrity.DigestRequest(layout="kv", block_ids=np.array([1, 2]).tobytes())),
                            5), HandshakeReply)
        assert len(ok.payload) == 8 and not ok.error


def test_a_slice_of_every_block_is_digested_as_the_blocks_it_names():
    """A DigestRequest for bytes [8, 24) of each of two parts of the blocks
    answers what digesting those bytes gathered gives, one digest per part."""
    data = np.random.default_rng(1).integers(0, 256, (4, 64), np.uint8)
    with agent("a") as a:
        a.register_blocks("kv", [data])
        reply = decode(request(a.listen(), encode(integrity.DigestRequest(
            layout="kv", block_ids=np.array([3, 1]).tobytes(), parts=2, offset=8, length=16)), 5), HandshakeReply)
    import xxhash

    want = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(data[[3, 1], lo:lo + 16]).tobytes()) for lo in (8, 40)]
    assert np.frombuffer(reply.payload, np.uint64).tolist() == want


@pytest.mark.parametrize("change", [lambda p: p[:-1], lambda p: p + b"\x00" * 8], ids=["short", "long"])
def test_a_digest_reply_of_the_wrong_size_fails_the_check(pair, monkeypatch, change):
    """A peer answering our digest request with bytes that are not its
    digests (7 bytes: not uint64s) made wait() raise numpy's ValueError."""
    import kvt.agent

    src, me, local, peer = pair
    real = kvt.agent.request

    def altered(*args, **kwargs):
        return encode(HandshakeReply(payload=change(decode(real(*args, **kwargs), HandshakeReply).payload)))

    monkeypatch.setattr(kvt.agent, "request", altered)
    with me.read_blocks(peer, [0, 1, 2], [5, 6, 7]) as t:
        with pytest.raises(IntegrityError, match="bytes of digests"):
            t.wait(10)
